"""Tests for the ``zero-runtime`` command line (zero_runtime.cli)."""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys

import pytest

from zero_runtime import cli
from zero_runtime.cli import COMMANDS, Command, format_bytes, main, parse_count

PAPER = ["estimate", "--params", "7.5e9", "--replicas", "64", "--accounting", "sc20"]


def run(capsys, argv):
    """main(argv) -> (exit code, stdout, stderr)."""
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys, argv):
    code, out, err = run(capsys, [*argv, "--json"])
    assert code == 0, err
    return json.loads(out), err


@pytest.mark.parametrize(
    ("stage", "device_bytes"),
    [("0", 120_000_000_000), ("1", 31_406_250_000), ("2", 16_640_625_000), ("3", 1_875_000_000)],
)
def test_estimate_json_paper_example(capsys, stage, device_bytes):
    data, _ = run_json(capsys, [*PAPER, "--stage", stage])
    assert data["device_bytes"] == device_bytes
    assert data["host_bytes"] == 0 and data["nvme_bytes"] == 0
    assert data["inputs"] == {
        "params": 7_500_000_000,
        "replicas": 64,
        "stage": int(stage),
        "offload_optimizer": "none",
        "offload_param": "none",
        "precision": "mixed",
        "optimizer": "adam",
        "accounting": "sc20",
        "config": None,
        "config_kind": None,
    }


def test_estimate_table(capsys):
    code, out, err = run(
        capsys, [*PAPER, "--stage", "3", "--offload-optimizer", "cpu", "--offload-param", "nvme"]
    )
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert "Ψ=7,500,000,000 params, N_d=64, stage 3, mixed precision, adam" in lines[0]
    assert lines[1] == "offload: optimizer=cpu, param=nvme"
    rows = {line.split("  ")[0]: line.split() for line in lines[3:] if line.strip()}
    assert rows["parameters"][1:] == ["2Ψ", "/", "64", "nvme", "234,375,000", "223.52", "MiB"]
    assert rows["gradients"][1:] == ["2Ψ", "/", "64", "device", "234,375,000", "223.52", "MiB"]
    assert rows["optimizer states"][2:] == [
        "12Ψ",
        "/",
        "64",
        "host",
        "1,406,250,000",
        "1.31",
        "GiB",
    ]
    assert rows["device total"][-3:] == ["234,375,000", "223.52", "MiB"]
    assert rows["host total"][-3:] == ["1,406,250,000", "1.31", "GiB"]
    assert rows["nvme total"][-3:] == ["234,375,000", "223.52", "MiB"]
    assert rows["all tiers"][-3:] == ["1,875,000,000", "1.75", "GiB"]


def test_estimate_fp32_and_optimizer(capsys):
    argv = ["estimate", "--params", "1B", "--replicas", "4", "--stage", "2"]
    data, _ = run_json(capsys, [*argv, "--precision", "fp32"])
    assert data["device_bytes"] == 7_000_000_000  # 4Ψ + (4 + 8)Ψ / 4
    data, _ = run_json(capsys, [*argv, "--precision", "fp32", "--optimizer", "sgd"])
    assert data["device_bytes"] == 5_000_000_000  # 4Ψ + 4Ψ / 4, K = 0


def test_estimate_zero_config_file(tmp_path, capsys):
    path = tmp_path / "zero.json"
    path.write_text(json.dumps({"stage": 3, "offload_param": "cpu"}), encoding="utf-8")
    data, _ = run_json(capsys, [*PAPER, "--config", str(path)])
    # the file's offload_optimizer is the ZeroConfig default, 'cpu'
    assert data["inputs"]["stage"] == 3 and data["inputs"]["config_kind"] == "zero"
    assert (data["device_bytes"], data["host_bytes"]) == (234_375_000, 1_640_625_000)
    # command-line flags override the file
    data, _ = run_json(
        capsys, [*PAPER, "--config", str(path), "--offload-optimizer", "none", "--stage", "3"]
    )
    assert (data["device_bytes"], data["host_bytes"]) == (1_640_625_000, 234_375_000)


def test_estimate_deepspeed_config_file(tmp_path, capsys):
    path = tmp_path / "ds.json"
    ds = {
        "train_batch_size": 32,
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme"},
            "reduce_bucket_size": "auto",
        },
    }
    path.write_text(json.dumps(ds), encoding="utf-8")
    data, err = run_json(capsys, [*PAPER, "--config", str(path)])
    assert data["inputs"]["config_kind"] == "deepspeed"
    assert data["inputs"]["offload_optimizer"] == "nvme"
    assert (data["device_bytes"], data["nvme_bytes"]) == (468_750_000, 1_406_250_000)
    assert err.splitlines() == [
        "zero-runtime: note: DeepSpeed key 'zero_optimization.reduce_bucket_size' is 'auto' "
        "(resolved by the Hugging Face Trainer from its arguments); using the ZeroConfig "
        "default reduce_bucket_size=500000000",
        "zero-runtime: note: DeepSpeed key 'train_batch_size' ignored: it has no counterpart "
        "in ZeroConfig",
    ]


BAD = [
    (["estimate", "--params", "7.5x", "--replicas", "64", "--stage", "1"], "invalid count '7.5x'"),
    (["estimate", "--params", "0", "--replicas", "64", "--stage", "1"], "whole number >= 1"),
    (["estimate", "--params", "1.5", "--replicas", "1", "--stage", "1"], "invalid count '1.5'"),
    (["estimate", "--params", "1e9", "--replicas", "0", "--stage", "1"], "expected an int >= 1"),
    ([*PAPER, "--stage", "5"], "argument --stage: invalid choice: 5"),
    ([*PAPER, "--stage", "1", "--offload-param", "gpu"], "invalid choice: 'gpu'"),
    ([*PAPER, "--stage", "2", "--offload-param", "cpu"], "requires stage 3"),
    (PAPER, "--stage is required unless --config, --model or a budget is given"),
    (["estimate", "--replicas", "2", "--stage", "1"], "give exactly one of --params N and --model"),
    ([*PAPER, "--config", "/nonexistent/zero.json"], "cannot read config file"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    ([], "the following arguments are required: COMMAND"),
]


@pytest.mark.parametrize(("argv", "fragment"), BAD)
def test_bad_arguments_exit_2_without_traceback(capsys, argv, fragment):
    code, out, err = run(capsys, argv)
    assert code == 2
    assert out == ""
    assert fragment in err
    assert "error:" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ('{"offload_optimiser": "cpu"}', "did you mean 'offload_optimizer'?"),
        ("{not json", "invalid JSON in"),
        ("[1]", "must hold a JSON object"),
        ('{"zero_optimization": {"stage": "auto"}}', "zero_optimization.stage='auto'"),
    ],
)
def test_bad_config_file_exits_2(tmp_path, capsys, content, fragment):
    path = tmp_path / "bad.json"
    path.write_text(content, encoding="utf-8")
    code, _, err = run(capsys, [*PAPER, "--config", str(path)])
    assert code == 2
    assert "zero-runtime estimate: error: " in err and fragment in err


def test_help_exits_0(capsys):
    code, out, _ = run(capsys, ["estimate", "--help"])
    assert code == 0 and "--offload-optimizer" in out


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("7500000000", 7_500_000_000),
        ("7.5e9", 7_500_000_000),
        ("7.5B", 7_500_000_000),
        ("1.3b", 1_300_000_000),
        ("350M", 350_000_000),
        ("12k", 12_000),
        ("1T", 10**12),
    ],
)
def test_parse_count(text, value):
    assert parse_count(text) == value


@pytest.mark.parametrize("text", ["", "abc", "1.5", "-3", "0", "inf", "nan", "1e", "7.5X"])
def test_parse_count_rejects(text):
    with pytest.raises(argparse.ArgumentTypeError):
        parse_count(text)


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        (234_375_000, "223.52 MiB"),
        (1_875_000_000, "1.75 GiB"),
        (120 * 10**12, "109.14 TiB"),
    ],
)
def test_format_bytes(n, text):
    assert format_bytes(n) == text


def test_adding_a_subcommand_is_one_entry(monkeypatch, capsys):
    def add_arguments(parser):
        parser.add_argument("--name", required=True)

    def run_hello(args):
        print(f"hello {args.name}")
        return 0

    monkeypatch.setitem(COMMANDS, "hello", Command("hello", "say hello", add_arguments, run_hello))
    assert run(capsys, ["hello", "--name", "zero"])[:2] == (0, "hello zero\n")
    with pytest.raises(ValueError, match="already registered"):
        cli.register(Command("hello", "again", add_arguments, run_hello))


def test_console_script_subprocess():
    script = pathlib.Path(sys.executable).with_name("zero-runtime")
    argv = [str(script)] if script.exists() else [sys.executable, "-m", "zero_runtime.cli"]
    proc = subprocess.run(
        [*argv, *PAPER, "--stage", "3", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert (data["device_bytes"], data["host_bytes"], data["nvme_bytes"]) == (1_875_000_000, 0, 0)


# -- SC21 accounting, --model and budgets -----------------------------------------------

MODELS = "tests.helpers.estimate_models"


def test_estimate_sc21_is_the_default(capsys):
    argv = ["estimate", "--params", "7.5e9", "--replicas", "64", "--stage", "2"]
    data, _ = run_json(capsys, argv)
    assert data["inputs"]["accounting"] == "sc21"
    # 2Ψ + 18Ψ/64 (DeepSpeed's estimate_zero2_model_states_mem_needs, no offload)
    assert data["device_bytes"] == 15_000_000_000 + 2_109_375_000
    assert data["breakdown"]["fp32_grads"]["bytes"] == 468_750_000


def test_estimate_model_single_choice_json(capsys):
    argv = ["estimate", "--model", f"{MODELS}:wide", "--replicas", "4", "--stage", "3"]
    data, _ = run_json(capsys, [*argv, "--offload-optimizer", "cpu", "--offload-param", "cpu"])
    assert data["model"]["num_params"] == 202_200_010
    assert data["model"]["largest_block_name"] == "wide"
    assert data["inputs"]["params"] == 202_200_010 and data["inputs"]["precision"] == "fp32"
    # Device: the working memory of the 'wide' unit (fp32 params + grads of 200.2M
    # elements) and the prefetched head kernel (2_000_000 elements, < 50M prefetch).
    # The head's 10-element bias stays replicated (< persistence_threshold 100_000).
    assert data["device_bytes"] == 8 * 200_200_000 + 4 * 2_000_000 + 4 * 10
    assert data["breakdown"]["params"]["page_size_bytes"] == 4 * 2**20


def test_estimate_model_lists_choices_and_the_smallest_fit(capsys):
    argv = ["estimate", "--model", f"{MODELS}:small_mixed", "--replicas", "2"]
    code, out, err = run(capsys, [*argv, "--device-budget", "20KiB"])
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("Memory per replica for every choice (sc21): Ψ=3,432 params")
    assert "compute 2 B/element" in lines[1]
    assert lines[2].startswith("budgets: device 20.00 KiB, host unlimited, nvme unlimited")
    assert lines[-1] == "smallest that fits: stage 2, offload_optimizer=cpu, offload_param=none"
    data, _ = run_json(capsys, [*argv, "--device-budget", "40KiB", "--host-budget", "1MiB"])
    assert len(data["choices"]) == 18
    best = data["smallest_fit"]
    assert (best["stage"], best["offload_optimizer"]) == (2, "none")
    # Stage 2 without offload, float32 states: 4Ψ + 12Ψ/2 + the bfloat16 cast of d32.
    assert best["device_bytes"] == 4 * 3_432 + 12 * 1_716 + 2 * 2_080
    for row in data["choices"]:
        assert row["fits"] == (row["device_bytes"] <= 40 * 1024 and row["host_bytes"] <= 2**20)
    # Offloaded states take whole 4 MiB pages per unit: 1 MiB of host never fits them.
    cpu = [r for r in data["choices"] if "cpu" in (r["offload_optimizer"], r["offload_param"])]
    assert all(r["shortfall"].get("host", 0) > 0 for r in cpu if r["host_bytes"])


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--model", "nocolon"], "expected MODULE:FUNCTION"),
        (["--model", "no_such_module_x:f"], "cannot import 'no_such_module_x'"),
        (["--model", f"{MODELS}:missing"], "has no function 'missing'"),
        (["--model", f"{MODELS}:not_a_model"], "returned int, expected a keras.Model"),
        (["--params", "1e9", "--model", f"{MODELS}:wide"], "give exactly one of"),
        (["--params", "1e9", "--device-budget", "0"], "invalid byte count '0'"),
        (["--params", "1e9", "--host-budget", "3 parsecs"], "invalid byte count"),
    ],
)
def test_estimate_model_bad_arguments(capsys, argv, fragment):
    code, out, err = run(capsys, ["estimate", "--replicas", "2", *argv])
    assert code == 2 and out == ""
    assert fragment in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("text", "value"),
    [("34359738368", 2**35), ("32GiB", 2**35), ("32GB", 32 * 10**9), ("3.2e10", 32 * 10**9)],
)
def test_parse_bytes(text, value):
    assert cli.parse_bytes(text) == value


def test_estimate_deepspeed_legacy_cpu_offload_offloads(tmp_path, capsys):
    path = tmp_path / "legacy.json"
    path.write_text('{"zero_optimization": {"stage": 2, "cpu_offload": true}}', encoding="utf-8")
    data, err = run_json(capsys, [*PAPER, "--config", str(path)])
    assert err == ""
    assert (data["inputs"]["stage"], data["inputs"]["offload_optimizer"]) == (2, "cpu")
    assert data["host_bytes"] == 1_406_250_000  # 12Ψ/64 on the host (SC20 accounting)


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ('{"zero_optimisation": {"stage": 3}}', "did you mean 'zero_optimization'?"),
        ('{"zero_optimization": {"stgae": 3}}', "did you mean 'stage'?"),
    ],
)
def test_estimate_deepspeed_typo_exits_2(tmp_path, capsys, content, fragment):
    path = tmp_path / "typo.json"
    path.write_text(content, encoding="utf-8")
    code, out, err = run(capsys, [*PAPER, "--config", str(path)])
    assert code == 2 and out == ""
    assert fragment in err


def test_estimate_hidden_size_resolves_auto(tmp_path, capsys):
    path = tmp_path / "auto.json"
    zero = '{"stage": 3, "stage3_param_persistence_threshold": "auto"}'
    path.write_text(f'{{"zero_optimization": {zero}}}', encoding="utf-8")
    argv = ["estimate", "--model", f"{MODELS}:small_mixed", "--replicas", "2", "--json"]
    code, out, err = run(capsys, [*argv, "--config", str(path), "--hidden-size", "8"])
    assert code == 0 and err == ""  # resolved: no "auto" note
    # persistence threshold 80: the 64-, 32- and 8-element biases stay replicated.
    assert json.loads(out)["model"]["persistent_params"] == 104


def test_estimate_model_factory_that_compiles_is_refused_clearly(capsys):
    argv = ["estimate", "--model", f"{MODELS}:compiled_sgd", "--replicas", "1", "--stage", "0"]
    code, out, err = run(capsys, argv)
    assert code == 2 and out == ""
    assert "'compiled_sgd' creates or reads a variable Keras cannot defer" in err
    assert "without model.compile()" in err and "--optimizer" in err
    # The optimizer is chosen on the command line instead: SGD with momentum, K = 4.
    argv = ["estimate", "--model", f"{MODELS}:small_mixed", "--replicas", "1", "--stage", "0"]
    data, _ = run_json(capsys, [*argv, "--optimizer", "sgd_momentum", "--accounting", "sc20"])
    assert data["inputs"]["optimizer"] == "sgd_momentum"
    assert data["device_bytes"] == (4 + 4 + 4) * 3_432


def test_oom_report_of_a_missing_path_says_it_does_not_exist(tmp_path, capsys):
    # A mistyped path is a usage error (exit 2) naming it, not "no run ran out of memory".
    missing = tmp_path / "no-such-logdir"
    assert main(["oom-report", str(missing)]) == 2
    assert f"{str(missing)!r} does not exist" in capsys.readouterr().err


def test_oom_report_does_not_import_tensorflow(tmp_path):
    """``zero-runtime oom-report`` prints a JSON file without importing TensorFlow (seconds
    of start-up and its log lines): it reads and formats the report through
    ``zero_runtime.oom_report`` alone."""
    from zero_runtime import oom_report

    failed = {"bytes": None, "tier": "device", "error_type": "DeviceBudgetExceededError"}
    row = oom_report.tier_row(
        12 << 20, [oom_report.holder("parameters", "param", 20 << 20)], 28 << 20, "allocator"
    )
    report = oom_report.build_report(
        step=0, failed=failed, tiers={"device": row}, recent_steps=[], config={},
        config_version=0, config_history=[], readings={}, advice=[], cause=None,
    )  # fmt: skip
    oom_report.write_json_atomic(str(tmp_path / "run" / oom_report.OOM_FILENAME), report)
    code = (
        "import sys\n"
        "from zero_runtime.cli import main\n"
        f"rc = main(['oom-report', {str(tmp_path)!r}])\n"
        "print('TF_LOADED', 'tensorflow' in sys.modules, rc)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=pathlib.Path(__file__).resolve().parent.parent,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "TF_LOADED False 0" in proc.stdout, proc.stdout[-2000:]
    assert "no single request: the budget is checked" in proc.stdout
    assert "unattributed" in proc.stdout  # the reading beyond the holders, as a holder
