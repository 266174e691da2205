"""The Memory Hierarchy View's TensorBoard plugin: it only registers the routes.

Where things live (``docs/http/`` documents every route's JSON shape and units):

- :mod:`tb_plugin.reader`: the one :class:`~tb_plugin.reader.Reader` over TensorBoard's
  data provider that every data route shares (the listing, decoded steps and records,
  their caches, run directories); :mod:`tb_plugin.layout` decodes a tag's layout and
  defines :class:`~tb_plugin.layout.DataContractError` (500).
- :mod:`tb_plugin.routes`: one module per view's routes, each split into a ``*_route``
  that parses the request (typed errors: 400, 404, ...) and a ``*_impl`` that takes
  plain arguments and returns data; :mod:`tb_plugin.routing` holds what they share
  (argument parsing, errors as JSON bodies, encoded answers).
- :mod:`tb_plugin.tuning` (the control channel's plugin side) and
  :mod:`tb_plugin.origin` (the DNS-rebinding guard of ``POST /tune``).

Keeping every step: TensorBoard samples summaries per plugin (100 steps with the Rust
server, 10 with the Python one) unless started with
``--samples_per_plugin=memory_hierarchy=0``, which keeps every step; the plugin then
reads all stored steps and thins each ``/series`` answer itself
from precomputed min/max levels (:mod:`tb_plugin.levels`), so a tier's peak stays visible.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from tensorboard.plugins import base_plugin

from tb_plugin import metadata, routing, tuning
from tb_plugin.cache import CostLru
from tb_plugin.reader import SERIES_CACHE_BYTES, Reader
from tb_plugin.routes import (
    checkpoints,
    diff,
    first_view,
    oom,
    records,
    restarts,
    runs,
    series,
    static,
    tune,
    whatif,
)
from tb_plugin.routes.series import ANSWER_CACHE_BYTES
from tb_plugin.routes.static import STATIC_DIR


class MemoryHierarchyPlugin(base_plugin.TBPlugin):
    """The Memory Hierarchy View: tier occupancy, page traffic and timing per run.

    Args:
        context: TensorBoard's ``TBContext``: ``data_provider``, ``logdir`` (where runs'
            directories are, for live tuning) and ``flags`` (``memory_hierarchy_tuning``,
            absent = off; ``host`` and ``bind_all`` for the DNS-rebinding guard) are used.
        static_dir: where the built frontend is (default :data:`STATIC_DIR`).
        series_cache_bytes: budget of the decoded-steps cache (bytes).
        answer_cache_bytes: budget of the encoded-answers cache and of the decoded
            json-records cache (bytes, each).

    Attributes:
        reader: the :class:`~tb_plugin.reader.Reader` every data route reads through.
        answers: the encoded ``/series`` answers (:func:`tb_plugin.routes.series.series_answer`).
        access: the tuning routes' :class:`~tb_plugin.routes.tune.TuningAccess`.
    """

    plugin_name = metadata.PLUGIN_NAME

    def __init__(
        self,
        context: base_plugin.TBContext,
        static_dir: str = STATIC_DIR,
        series_cache_bytes: int = SERIES_CACHE_BYTES,
        answer_cache_bytes: int = ANSWER_CACHE_BYTES,
    ) -> None:
        flags = getattr(context, "flags", None)
        logdir = getattr(context, "logdir", None) or getattr(flags, "logdir", None) or ""
        self.answers: CostLru[routing.Answer] = CostLru(answer_cache_bytes)
        self.reader = Reader(
            context.data_provider,
            logdir,
            series_cache_bytes=series_cache_bytes,
            records_cache_bytes=answer_cache_bytes,
            on_indexed=self._encode_first_answers,
            index_json_tags=first_view.JSON_TAGS,
        )
        self.access = tune.TuningAccess(
            enabled=bool(getattr(flags, tuning.FLAG_NAME, False)), flags=flags
        )
        self._static_dir = static_dir

    def _encode_first_answers(self, ctx: Any, experiment: str, run: str, tag: str) -> None:
        """After the indexer brought a series up to date: encode the /series answer the
        view's first paint asks of it (tiers and readings at the view's point budget), so
        even a first visit's ``/first_view`` is answered from the answer cache."""
        if tag in first_view.SERIES_TAGS:
            series.series_answer(
                self.reader, self.answers, ctx, experiment, run, tag, first_view.VIEW_POINTS, None
            )

    def get_plugin_apps(self) -> dict[str, Callable]:
        """Map routes (under ``/data/plugin/memory_hierarchy``) to WSGI apps."""
        reader, access = self.reader, self.access
        return {
            "/runs": functools.partial(runs.runs_route, reader),
            "/series": functools.partial(series.series_route, reader, self.answers),
            "/first_view": functools.partial(first_view.first_view_route, reader, self.answers),
            "/json": functools.partial(records.json_route, reader),
            "/tuning": functools.partial(tune.tuning_route, reader, access),
            "/tuning_states": functools.partial(tune.tuning_states_route, reader, access),
            "/tune": functools.partial(tune.tune_route, reader, access),
            "/whatif": functools.partial(whatif.whatif_route, reader),
            "/oom": functools.partial(oom.oom_route, reader),
            "/checkpoints": functools.partial(checkpoints.checkpoints_route, reader),
            "/restarts": functools.partial(restarts.restarts_route, reader),
            "/diff": functools.partial(diff.diff_route, reader),
            "/*": functools.partial(static.static_route, self._static_dir),
        }

    def is_active(self) -> bool:
        """Return False at once: TensorBoard marks the plugin active by its data.

        ``data_plugin_names()`` matches the data provider's ``list_plugins()``, which is
        how TensorBoard enables the tab without this method scanning the logdir.
        """
        return False

    def data_plugin_names(self) -> tuple[str, ...]:
        """The summary plugin names whose data this plugin reads."""
        return (metadata.PLUGIN_NAME,)

    def frontend_metadata(self) -> base_plugin.FrontendMetadata:
        """Load the frontend as an ES module in an iframe (``/index.js``, ``render()``)."""
        return base_plugin.FrontendMetadata(es_module_path="/index.js", tab_name="Memory Hierarchy")
