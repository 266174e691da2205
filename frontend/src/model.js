// The model: owns fetching from the plugin's HTTP API (docs/http/index.md) and a cache.
// URLs are relative to this module's own URL: TensorBoard serves it at
// <root>/data/plugin/memory_hierarchy/index.js, so `./runs` is the plugin's /runs route,
// whatever path prefix or experiment id TensorBoard is served under.

export const TAG_TIERS = 'memory_hierarchy/tiers';
export const TAG_READINGS = 'memory_hierarchy/readings';
export const TAG_PAGES = 'memory_hierarchy/pages';
export const TAG_TIMING = 'memory_hierarchy/timing';
export const TAG_RUN_INFO = 'memory_hierarchy/run_info';
export const TAG_PLACEMENT = 'memory_hierarchy/placement';
export const TAG_ESTIMATE = 'memory_hierarchy/estimate';
export const TAG_CONFIG_EVENT = 'memory_hierarchy/config_event';
export const TAG_OOM = 'memory_hierarchy/oom';
export const TAG_CHECKPOINT = 'memory_hierarchy/checkpoint';
// Restores have their own tag, so TensorBoard's load_fast (one value per run, tag and step)
// keeps a save and a restore at one step (a resumed job); /checkpoints merges both.
export const TAG_CHECKPOINT_RESTORE = 'memory_hierarchy/checkpoint_restore';
export const CHECKPOINT_TAGS = [TAG_CHECKPOINT, TAG_CHECKPOINT_RESTORE];

// The header POST /tune requires (a cross-site form cannot set it; see docs/http/tuning.md).
export const TUNING_HEADER = 'X-Memory-Hierarchy-Tuning';

// Points per chart series asked of /series (the server keeps every peak when thinning);
// about one per horizontal pixel of a chart.
export const CHART_POINTS = 1000;
// ?points=0 asks for every stored step (exports).
export const FULL_POINTS = 0;

/** An HTTP error from the plugin, with the server's message. */
export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

export class Model {
  /**
   * @param {URL|string} base the plugin's route prefix, ending in '/'.
   * @param {typeof fetch} fetchFn injectable for tests.
   */
  constructor(base, fetchFn = (...args) => fetch(...args)) {
    this.base = new URL(base);
    this.fetchFn = fetchFn;
    // `${route} ${run} ${tag}` -> {maxStep, data}: a series is fetched again only when
    // /runs reports a newer max_step for it, so polling a quiet run costs one /runs call.
    this.cache = new Map();
  }

  /** The absolute URL of a route with query parameters (also used for export links). */
  url(route, params = {}) {
    const url = new URL(route, this.base);
    for (const [key, value] of Object.entries(params)) url.searchParams.set(key, String(value));
    return url.href;
  }

  async getJson(route, params = {}, init = {}) {
    const url = this.url(route, params);
    const headers = { Accept: 'application/json', ...(init.headers ?? {}) };
    const response = await this.fetchFn(url, { ...init, headers });
    let body = null;
    try {
      body = await response.json();
    } catch {
      body = null;
    }
    if (!response.ok) {
      const message = body?.error?.message ?? `${response.status} ${response.statusText}`;
      throw new ApiError(response.status, message);
    }
    return body;
  }

  /** @returns {Promise<Array<{run: string, tags: Object}>>} runs with memory_hierarchy data */
  async runs() {
    return (await this.getJson('./runs')).runs;
  }

  /**
   * The /runs listing and the first paint's answers in one request (GET /first_view):
   * the embedded /series and /json answers are put in the cache under the max_step the
   * listing gives, so the refresh that follows finds them there.
   * @param {string[]} runs the panels to fill first (the remembered selection), or [] for
   *   the server's default (of the `limit` most recent runs, the first `eager` by name)
   * @param {{limit: number, eager: number}} counts
   * @returns {Promise<Array<{run: string, tags: Object}>>} as runs()
   */
  async firstView(runs, { limit, eager }) {
    const url = new URL('./first_view', this.base);
    for (const run of runs) url.searchParams.append('run', run);
    url.searchParams.set('limit', String(limit));
    url.searchParams.set('eager', String(eager));
    url.searchParams.set('points', String(CHART_POINTS));
    const body = await this.getJson(url.href);
    const tagsOf = new Map(body.runs.map((entry) => [entry.run, entry.tags]));
    const seed = (route, answers, extra) => {
      for (const [run, byTag] of Object.entries(answers ?? {})) {
        for (const [tag, data] of Object.entries(byTag)) {
          const maxStep = tagsOf.get(run)?.[tag]?.max_step;
          if (data?.error || maxStep === undefined) continue; // its own route reports it
          this.cache.set(this.key(route, run, tag, extra), { maxStep, data });
        }
      }
    };
    seed('./series', body.series, { points: body.points });
    seed('./json', body.json, {});
    return body.runs;
  }

  key(route, run, tag, extra) {
    return JSON.stringify([route, run, tag, extra]);
  }

  async cached(route, run, tag, maxStep, extra = {}) {
    const key = this.key(route, run, tag, extra);
    const hit = this.cache.get(key);
    if (hit && hit.maxStep === maxStep) return hit.data;
    // One request per key at a time: a poll that starts while the previous one for the
    // same data is still in flight shares its promise.
    if (hit?.pending && hit.pendingStep === maxStep) return hit.pending;
    const pending = this.getJson(route, { run, tag, ...extra });
    this.cache.set(key, { ...hit, pending, pendingStep: maxStep });
    try {
      const data = await pending;
      this.cache.set(key, { maxStep, data });
      return data;
    } catch (err) {
      if (hit?.data) this.cache.set(key, { maxStep: hit.maxStep, data: hit.data });
      else this.cache.delete(key);
      throw err;
    }
  }

  /** Columnar series of a matrix/vector tag (see /series); cached by max_step. */
  series(run, tag, maxStep, points = CHART_POINTS) {
    return this.cached('./series', run, tag, maxStep, { points });
  }

  /** Export link of a series: format 'csv' or 'json', points CHART_POINTS or FULL_POINTS. */
  seriesExportUrl(run, tag, format, points) {
    return this.url('./series', { run, tag, points, format });
  }

  /** Export link of a json tag: format 'csv' or 'json'. */
  jsonExportUrl(run, tag, format) {
    return this.url('./json', { run, tag, format });
  }

  /** Events of a json tag (see /json); cached by max_step. */
  json(run, tag, maxStep) {
    return this.cached('./json', run, tag, maxStep);
  }

  /** The latest out-of-memory post-mortem of a run (see /oom); cached by max_step. */
  oom(run, maxStep) {
    return this.cached('./oom', run, TAG_OOM, maxStep);
  }

  /**
   * A run's checkpoint saves and restores (see /checkpoints); cached by `version`, a value
   * that changes when either checkpoint tag gets a record (e.g. both max_steps joined).
   */
  checkpoints(run, version) {
    return this.cached('./checkpoints', run, TAG_CHECKPOINT, version);
  }

  /**
   * A job's restarts, resizes and goodput (GET /restarts; not cached: the launcher writes
   * a file, not summaries, so no max_step tells when it changed).
   */
  restarts(run) {
    return this.getJson('./restarts', { run });
  }

  /**
   * Run B compared with run A (GET /diff: B − A per step, summaries, placement diff);
   * not cached (the view asks again only when either run's steps grew).
   */
  diff(a, b, points = CHART_POINTS) {
    return this.getJson('./diff', { a, b, points });
  }

  /** Download link of a /diff answer: format 'csv' (part 'steps' or 'placement') or 'json'. */
  diffExportUrl(a, b, format, part = 'steps') {
    return this.url('./diff', { a, b, format, part });
  }

  /** A run's tunable keys, values in effect and request state (GET /tuning; not cached). */
  tuning(run) {
    return this.getJson('./tuning', { run });
  }

  /**
   * Several runs' /tuning answers in one request (GET /tuning_states; not cached):
   * resolves to {runs: {run: answer or {error: {code, message}}}}.
   * @param {string[]} runs
   */
  tuningStates(runs) {
    const url = new URL('./tuning_states', this.base);
    for (const run of runs) url.searchParams.append('run', run);
    return this.getJson(url.href);
  }

  /**
   * A proposed change's predicted effect (GET /whatif; not cached, nothing written):
   * resolves to {run, updates, available, reason, recorded, predicted, oom, notes, ...}.
   * @param {string} run
   * @param {Object<string, number>} updates key -> proposed value
   */
  whatif(run, updates) {
    return this.getJson('./whatif', { run, updates: JSON.stringify(updates) });
  }

  /**
   * Ask a running job to change tunable settings (POST /tune); resolves to the answer
   * ({run, version, updates, request}); rejects with an ApiError carrying the server's
   * message (400 invalid value, 403 tuning off, ...).
   * @param {string} run
   * @param {Object<string, number>} updates key -> new value
   */
  tune(run, updates) {
    return this.getJson(
      './tune',
      { run },
      {
        method: 'POST',
        headers: { 'Content-Type': 'application/json', [TUNING_HEADER]: '1' },
        body: JSON.stringify({ updates }),
      },
    );
  }
}
