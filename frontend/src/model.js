// The model: owns fetching from the plugin's HTTP API (docs/http_api.md) and a cache.
// URLs are relative to this module's own URL: TensorBoard serves it at
// <root>/data/plugin/memory_hierarchy/index.js, so `./runs` is the plugin's /runs route,
// whatever path prefix or experiment id TensorBoard is served under.

export const TAG_TIERS = 'memory_hierarchy/tiers';
export const TAG_RUN_INFO = 'memory_hierarchy/run_info';

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

  async getJson(route, params = {}) {
    const url = new URL(route, this.base);
    for (const [key, value] of Object.entries(params)) url.searchParams.set(key, value);
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

  async cached(route, run, tag, maxStep) {
    const key = `${route} ${run} ${tag}`;
    const hit = this.cache.get(key);
    if (hit && hit.maxStep === maxStep) return hit.data;
    const data = await this.getJson(route, { run, tag });
    this.cache.set(key, { maxStep, data });
    return data;
  }

  /** Columnar series of a matrix/vector tag (see /series); cached by max_step. */
  series(run, tag, maxStep) {
    return this.cached('./series', run, tag, maxStep);
  }

  /** Events of a json tag (see /json); cached by max_step. */
  json(run, tag, maxStep) {
    return this.cached('./json', run, tag, maxStep);
  }
}
