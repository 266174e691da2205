"""The paths a run writes to are checked when the strategy is created
(zero_runtime/config/paths.py): a missing ``nvme_path`` or ``logdir`` is created, and one
that cannot be used (a file, a read-only disk) is one clear error before anything trains,
with nothing written in its place."""

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
    under_file = a_file / "nvme"
    cases = {
        str(a_file): "is a file, not a directory",
        str(under_file): r"cannot create .* \(Not a directory\)",
    }
    for path, why in cases.items():
        with pytest.raises(
            ZeroConfigError, match=rf"nvme_path='{path}' is invalid: .*{why}"
        ) as info:
            zero_runtime.ZeroInfinityStrategy(_nvme_config(path, key))
        assert info.value.key == "nvme_path"
        assert info.value.value == path
    assert a_file.read_text() == "data"  # nothing written in its place


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


def test_missing_directories_are_created(tmp_path):
    nvme = tmp_path / "disk" / "nvme"
    assert check_nvme_path(str(nvme)) == str(nvme)
    assert nvme.is_dir()  # with its parents, as DeepSpeed creates its swap folders
    logdir = tmp_path / "logs" / "run1"
    assert check_logdir(str(logdir)) == str(logdir)
    assert logdir.is_dir()


def test_bad_logdir_refused_when_the_strategy_is_created(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("data")
    with pytest.raises(ValueError, match=rf"logdir='{a_file}' is invalid: .* is a file"):
        zero_runtime.ZeroInfinityStrategy(ZeroConfig(stage=1), logdir=str(a_file))
    under_file = a_file / "run1"
    with pytest.raises(ValueError, match=rf"logdir='{under_file}' is invalid: cannot create"):
        zero_runtime.ZeroInfinityStrategy(ZeroConfig(stage=1), logdir=str(under_file))
    assert a_file.read_text() == "data"
