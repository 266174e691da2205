"""The paths a run writes to are checked when the strategy is created
(zero_runtime/config/paths.py): a bad ``nvme_path`` or ``logdir`` is one clear error
before anything trains, and nothing is created in its place."""

from __future__ import annotations

import pytest
from helpers import faults

import zero_runtime
from zero_runtime.config import ZeroConfig, ZeroConfigError
from zero_runtime.config.paths import check_logdir, check_nvme_path


def _nvme_config(path: str, key: str) -> ZeroConfig:
    if key == "offload_param":
        return ZeroConfig(stage=3, offload_param="nvme", nvme_path=path)
    return ZeroConfig(stage=2, offload_optimizer="nvme", nvme_path=path)


@pytest.mark.parametrize("key", ["offload_param", "offload_optimizer"])
def test_bad_nvme_path_refused_when_the_strategy_is_created(tmp_path, key):
    a_file = tmp_path / "a_file"
    a_file.write_text("data")
    missing = tmp_path / "missing"
    cases = {
        str(a_file): "is a file, not a directory",
        str(missing): r"does not exist \(create it first: mkdir -p\)",
    }
    for path, why in cases.items():
        with pytest.raises(
            ZeroConfigError, match=rf"nvme_path='{path}' is invalid: .*{why}"
        ) as info:
            zero_runtime.ZeroInfinityStrategy(_nvme_config(path, key))
        assert info.value.key == "nvme_path"
        assert info.value.value == path
    assert a_file.read_text() == "data"  # nothing written in its place
    assert not missing.exists()


def test_read_only_nvme_path_and_logdir_refused(tmp_path):
    """A tmpfs mounted read-only (chmod would not stop root)."""
    ro = faults.mount_tmpfs_or_skip(tmp_path / "ro", "ro,size=1m")
    try:
        with pytest.raises(ZeroConfigError, match="is not writable by this process"):
            check_nvme_path(str(ro))
        with pytest.raises(ValueError, match=r"cannot create .* \(Read-only file system\)"):
            check_logdir(str(ro / "run1"))
        with pytest.raises(ValueError, match="is not writable by this process"):
            check_logdir(str(ro))
    finally:
        faults.unmount(ro)


def test_good_paths_accepted(tmp_path):
    assert check_nvme_path(str(tmp_path)) == str(tmp_path)
    logdir = tmp_path / "logs" / "run1"
    assert check_logdir(str(logdir)) == str(logdir)
    assert logdir.is_dir()  # created, as TensorBoard's writers would


def test_bad_logdir_refused_when_the_strategy_is_created(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("data")
    with pytest.raises(ValueError, match=rf"logdir='{a_file}' is invalid: .* is a file"):
        zero_runtime.ZeroInfinityStrategy(ZeroConfig(stage=1), logdir=str(a_file))
    under_file = a_file / "run1"
    with pytest.raises(ValueError, match=rf"logdir='{under_file}' is invalid: cannot create"):
        zero_runtime.ZeroInfinityStrategy(ZeroConfig(stage=1), logdir=str(under_file))
    assert a_file.read_text() == "data"
