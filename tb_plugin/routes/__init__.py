"""The plugin's HTTP routes, one module per view's routes (registered by :mod:`tb_plugin.plugin`).

- :mod:`~tb_plugin.routes.runs`: ``GET /runs``, the runs and their tags (the run selector).
- :mod:`~tb_plugin.routes.first_view`: ``GET /first_view``, the listing and the first
  panels' ``/series`` and ``/json`` answers in one request (the first paint).
- :mod:`~tb_plugin.routes.series`: ``GET /series``, a matrix or vector tag over steps
  (tier, timing and page charts), thinned keeping peaks; downloads.
- :mod:`~tb_plugin.routes.records`: ``GET /json``, every record of a json tag (run info,
  placement, estimate, config events); downloads.
- :mod:`~tb_plugin.routes.tune`: ``GET /tuning`` and ``POST /tune``, the live-tuning panel.
- :mod:`~tb_plugin.routes.oom`: ``GET /oom``, the out-of-memory post-mortem.
- :mod:`~tb_plugin.routes.checkpoints`: ``GET /checkpoints``, saves and restores.
- :mod:`~tb_plugin.routes.restarts`: ``GET /restarts``, a job's restarts, resizes and
  goodput (``zero-runtime launch --logdir``).
- :mod:`~tb_plugin.routes.diff`: ``GET /diff``, two runs compared (B - A per step and
  the placement diff); downloads.
- :mod:`~tb_plugin.routes.static`: ``GET /<asset>``, the built frontend.

Each route is a ``*_route(deps..., request)`` that parses the request (helpers in
:mod:`tb_plugin.routing`) and a ``*_impl(deps..., plain arguments)`` that returns
JSON-ready data; the data routes' dependency is the shared
:class:`tb_plugin.reader.Reader`.
"""
