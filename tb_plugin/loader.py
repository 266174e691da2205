"""How TensorBoard loads the Memory Hierarchy plugin, and the plugin's own flag.

``setup.py`` points the ``tensorboard_plugins`` entry point here, so TensorBoard calls
:meth:`MemoryHierarchyLoader.define_flags` before parsing its command line and
:meth:`MemoryHierarchyLoader.load` to build the plugin. The flag:

``--memory_hierarchy_tuning`` (off by default)
    Let the tab write live-tuning requests into the runs' directories (``POST /tune``).
    Off, the tab shows the tunable values read-only and ``POST /tune`` answers 403.
    ``--memory_hierarchy_tuning``, ``--memory_hierarchy_tuning=true`` and ``=false`` are
    accepted.
"""

from __future__ import annotations

import argparse
from typing import Any

from tensorboard.plugins import base_plugin

from tb_plugin import tuning

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def parse_bool_flag(text: str) -> bool:
    """``true/false`` (also ``1/0``, ``yes/no``, ``on/off``, any case) as a bool.

    Raises:
        argparse.ArgumentTypeError: any other text.
    """
    lowered = str(text).strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


class MemoryHierarchyLoader(base_plugin.TBLoader):
    """Defines ``--memory_hierarchy_tuning`` and builds :class:`MemoryHierarchyPlugin`."""

    def define_flags(self, parser: argparse.ArgumentParser) -> None:
        """Add the plugin's flag group to TensorBoard's ``serve`` parser."""
        group = parser.add_argument_group("memory_hierarchy")
        group.add_argument(
            f"--{tuning.FLAG_NAME}",
            nargs="?",
            const=True,
            default=False,
            type=parse_bool_flag,
            metavar="BOOL",
            help="Let the Memory Hierarchy tab change tunable settings of running jobs "
            "(writes memory_hierarchy_control.json into run directories). Off by default.",
        )

    def load(self, context: base_plugin.TBContext) -> Any:
        """The plugin, tuning enabled when the flag is set (``context.flags``)."""
        from tb_plugin.plugin import MemoryHierarchyPlugin

        return MemoryHierarchyPlugin(context)
