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
    assert sorted(os.listdir(run)) == [control.REQUEST_FILE]  # no temporary file left
