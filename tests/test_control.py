"""Live-tuning channel: requests written atomically, decided at step boundaries."""

from __future__ import annotations

import json
import math
import os

import pytest

from zero_runtime import control
from zero_runtime.config import ZeroConfig, ZeroConfigError

MIB = 1 << 20


@pytest.fixture
def channel(tmp_path):
    return control.ControlChannel(str(tmp_path), ZeroConfig(device_budget_bytes=512 * MIB))


def _raw_request(run_dir, obj) -> None:
    """Write a request file the way a buggy or hostile writer might (not atomically)."""
    with open(os.path.join(run_dir, control.REQUEST_FILE), "w", encoding="utf-8") as fh:
        fh.write(obj if isinstance(obj, str) else json.dumps(obj))


def test_no_request_file_costs_nothing(channel):
    assert channel.poll(0) is None
    assert channel.config.device_budget_bytes == 512 * MIB and channel.version == 0


def test_sequence_of_versions_out_of_order_and_malformed(channel, tmp_path):
    run = str(tmp_path)
    assert control.write_request(run, {"device_budget_bytes": 256 * MIB}) == 1
    first = channel.poll(10)
    assert first.status is control.Status.APPLIED and first.step == 10
    assert first.changes == {"device_budget_bytes": {"old": 512 * MIB, "new": 256 * MIB}}
    assert channel.config.device_budget_bytes == 256 * MIB and channel.version == 1
    assert channel.poll(11) is None  # unchanged file: nothing to decide

    assert control.write_request(run, {"telemetry_every_n_steps": 5}) == 2
    assert channel.poll(12).status is control.Status.APPLIED
    assert channel.config.telemetry_every_n_steps == 5
    assert channel.config.device_budget_bytes == 256 * MIB  # earlier change kept

    # An older version arriving late (e.g. a slow shared file system) is ignored.
    _raw_request(run, {"version": 1, "updates": {"device_budget_bytes": 64 * MIB}})
    old = channel.poll(13)
    assert old.status is control.Status.IGNORED and "not newer than 2" in old.reason
    assert channel.config.device_budget_bytes == 256 * MIB

    # A malformed file is rejected; the job goes on with its config.
    _raw_request(run, '{"version": 3, "updates": {"device_budget_bytes": ')
    bad = channel.poll(14)
    assert bad.status is control.Status.REJECTED and "unreadable request" in bad.reason
    assert channel.version == 2

    # The acknowledgement file tells the plugin what happened last.
    ack = control.read_ack(run)
    assert ack["status"] == "rejected" and ack["step"] == 14
    assert [o.status.value for o in channel.history] == [
        "applied",
        "applied",
        "ignored",
        "rejected",
    ]


@pytest.mark.parametrize(
    ("updates", "message"),
    [
        ({"stage": 3}, "cannot be tuned live"),
        ({"device_budget": 1}, "unknown key 'device_budget'"),
        ({"device_budget_bytes": -1}, "device_budget_bytes=-1"),
        ({"device_budget_bytes": 1.5}, "device_budget_bytes=1.5"),
        ({"device_budget_bytes": float("nan")}, "device_budget_bytes=nan"),
        ({"max_live_parameters": True}, "max_live_parameters=True"),
        ("not a mapping", "mapping"),
    ],
)
def test_invalid_requests_are_rejected_with_the_reason(channel, tmp_path, updates, message):
    _raw_request(str(tmp_path), {"version": 1, "updates": updates})
    outcome = channel.poll(3)
    assert outcome.status is control.Status.REJECTED
    assert message in outcome.reason
    assert channel.config == ZeroConfig(device_budget_bytes=512 * MIB)


def test_oversized_request_is_rejected_unread(channel, tmp_path):
    _raw_request(str(tmp_path), " " * (control.MAX_REQUEST_BYTES + 1))
    outcome = channel.poll(0)
    assert outcome.status is control.Status.REJECTED and "larger than" in outcome.reason


@pytest.mark.parametrize(
    "updates",
    [
        {"stage": 2},
        {"nvme_path": "/x"},
        {"host_budget_bytes": math.inf},
        {"persistence_threshold": -3},
        {},
    ],
)
def test_write_request_validates_and_writes_nothing(tmp_path, updates):
    with pytest.raises(ZeroConfigError):
        control.write_request(str(tmp_path), updates)
    assert os.listdir(tmp_path) == []


def test_write_request_is_atomic_and_versioned(tmp_path):
    run = str(tmp_path)
    for expected in (1, 2, 3):
        assert control.write_request(run, {"max_reuse_distance": expected}) == expected
    with open(os.path.join(run, control.REQUEST_FILE), encoding="utf-8") as fh:
        request = json.load(fh)
    assert request["version"] == 3 and request["updates"] == {"max_reuse_distance": 3}
    # Not yet acknowledged: a new request keeps the pending one's other keys.
    control.write_request(run, {"persistence_threshold": 7})
    with open(os.path.join(run, control.REQUEST_FILE), encoding="utf-8") as fh:
        merged = json.load(fh)
    assert merged["updates"] == {"max_reuse_distance": 3, "persistence_threshold": 7}
    assert sorted(os.listdir(run)) == [control.REQUEST_FILE]  # no temporary file left
    # Once the runtime has decided on a version, the next request starts afresh.
    channel = control.ControlChannel(run, ZeroConfig())
    assert channel.poll(0).status is control.Status.APPLIED
    control.write_request(run, {"max_live_parameters": 5})
    with open(os.path.join(run, control.REQUEST_FILE), encoding="utf-8") as fh:
        assert json.load(fh)["updates"] == {"max_live_parameters": 5}


def test_running_job_applies_a_request_at_a_step_boundary(tmp_path, cpu_devices):
    """A request written while a job runs takes effect at the next step and is audited."""
    import keras
    import numpy as np
    import tensorflow as tf
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    import zero_runtime
    from tb_plugin import metadata

    run = tmp_path / "run"
    strategy = zero_runtime.ZeroInfinityStrategy(logdir=str(run))
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile(optimizer="adam", loss="mse")
    x = np.ones((64, 4), "float32")
    ds = tf.data.Dataset.from_tensor_slices((x, x[:, :2])).batch(8)

    class RequestAtBatch(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 2:  # after step 2 ended: the next boundary (end of step 3) polls
                assert control.read_closed(str(run)) is None  # the job reads requests
                control.write_request(str(run), {"telemetry_every_n_steps": 2})
                control.write_request(str(run), {"device_budget_bytes": 300 * MIB})

    model.fit(ds, epochs=1, verbose=0, shuffle=False, callbacks=[RequestAtBatch()])
    strategy.close()
    assert control.read_closed(str(run))["step"] == 8  # closed after steps 0-7
    assert strategy.config.telemetry_every_n_steps == 2
    assert strategy.config.device_budget_bytes == 300 * MIB
    assert strategy.runtime.config_version == 2
    acc = EventAccumulator(str(run), size_guidance={"tensors": 0})
    acc.Reload()
    steps = [e.step for e in acc.Tensors(metadata.TAG_TIERS)]
    assert steps == [0, 1, 2, 3, 4, 6]  # every step until the change at step 4, then every 2nd
    events = [
        (e.step, json.loads(tensor_util.make_ndarray(e.tensor_proto).item()))
        for e in acc.Tensors(metadata.TAG_CONFIG_EVENT)
    ]
    assert [(s, ev["status"], ev["version"]) for s, ev in events] == [(4, "applied", 2)]
    assert events[0][1]["changes"] == {
        "telemetry_every_n_steps": {"old": 1, "new": 2},
        "device_budget_bytes": {"old": None, "new": 300 * MIB},
    }


@pytest.mark.parametrize("bad_version", ["2", None, 1.5, True, [1]])
def test_write_request_over_a_malformed_ack_treats_it_as_undecided(tmp_path, bad_version):
    """An acknowledgement whose version is not an int counts as "nothing decided yet"
    (not a TypeError in the comparison): the pending request's changes are kept and the
    version still increases."""
    run = str(tmp_path)
    control.write_request(run, {"max_reuse_distance": 4})
    with open(os.path.join(run, control.ACK_FILE), "w", encoding="utf-8") as fh:
        json.dump({"version": bad_version, "status": "applied", "step": 3}, fh)
    assert control.write_request(run, {"persistence_threshold": 9}) == 2
    with open(os.path.join(run, control.REQUEST_FILE), encoding="utf-8") as fh:
        request = json.load(fh)
    assert request["updates"] == {"max_reuse_distance": 4, "persistence_threshold": 9}
