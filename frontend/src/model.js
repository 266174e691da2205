// The model: owns fetching from the plugin's HTTP API (docs/http_api.md) and a cache.
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

  async getJson(route, params = {}) {
    const url = this.url(route, params);
    const response = await this.fetchFn(url, { headers: { Accept: 'application/json' } });
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

  async cached(route, run, tag, maxStep, extra = {}) {
    const key = JSON.stringify([route, run, tag, extra]);
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
}
