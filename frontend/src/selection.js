// Which runs are selected: a bounded default (the most recent runs) and the user's own
// choice, remembered across visits. Pure functions (tested with node --test) plus the
// small localStorage wrapper the run selector uses.

// Runs selected by default on a first visit: the most recent ones. With hundreds of runs
// in a logdir, selecting every run would draw hundreds of panels before anything shows.
export const DEFAULT_SELECTED_RUNS = 10;
// localStorage key of the remembered choice ({selected: [...], known: [...]}).
export const STORAGE_KEY = 'memory_hierarchy.run_selection.v1';

/**
 * A run's recency: the newest max_wall_time (seconds since the epoch) over its tags in a
 * /runs entry; 0 when it has none.
 * @param {{tags: Object<string, {max_wall_time?: number}>}} entry
 */
export function recencyOf(entry) {
  let latest = 0;
  for (const info of Object.values(entry?.tags ?? {})) {
    if (Number.isFinite(info?.max_wall_time) && info.max_wall_time > latest) {
      latest = info.max_wall_time;
    }
  }
  return latest;
}

/**
 * The runs ordered from the most recent (larger recency) to the oldest; ties by name.
 * @param {string[]} runs
 * @param {Map<string, number>} recency run -> seconds since the epoch
 */
export function byRecency(runs, recency) {
  return [...runs].sort((a, b) => {
    const d = (recency.get(b) ?? 0) - (recency.get(a) ?? 0);
    return d !== 0 ? d : a < b ? -1 : a > b ? 1 : 0;
  });
}

/**
 * The selection after the run list changed.
 *
 * - Runs already known keep their state (selected or not): the user's choice wins.
 * - Runs seen for the first time are selected, most recent first, while fewer than
 *   `limit` runs are selected (so a first visit selects the `limit` most recent runs, and
 *   a new run of a small logdir shows up selected, as in TensorBoard).
 * - Runs that disappeared leave the selection (they stay known).
 *
 * @param {object} state
 * @param {string[]} state.runs the runs now listed
 * @param {Map<string, number>} state.recency run -> recency (seconds since the epoch)
 * @param {Set<string>} state.selected the current selection
 * @param {Set<string>} state.known runs seen before (now or on an earlier visit)
 * @param {number} [state.limit] DEFAULT_SELECTED_RUNS by default
 * @returns {{selected: Set<string>, known: Set<string>, changed: boolean}}
 */
export function mergeSelection({ runs, recency, selected, known, limit = DEFAULT_SELECTED_RUNS }) {
  const listed = new Set(runs);
  const nextSelected = new Set([...selected].filter((r) => listed.has(r)));
  const nextKnown = new Set(known);
  let changed = nextSelected.size !== selected.size;
  for (const run of byRecency(runs.filter((r) => !known.has(r)), recency)) {
    nextKnown.add(run);
    changed = true;
    if (nextSelected.size < limit) nextSelected.add(run);
  }
  return { selected: nextSelected, known: nextKnown, changed };
}

/**
 * The remembered choice, or null (nothing stored, storage unavailable, or unreadable).
 * @param {Storage|null} storage
 * @returns {{selected: Set<string>, known: Set<string>}|null}
 */
export function loadSelection(storage) {
  try {
    const raw = storage?.getItem(STORAGE_KEY);
    if (!raw) return null;
    const parsed = JSON.parse(raw);
    if (!Array.isArray(parsed?.selected) || !Array.isArray(parsed?.known)) return null;
    const strings = (list) => list.filter((r) => typeof r === 'string');
    return { selected: new Set(strings(parsed.selected)), known: new Set(strings(parsed.known)) };
  } catch {
    return null;
  }
}

/**
 * Remember the choice (best effort: a full or disabled storage is ignored).
 * @param {Storage|null} storage
 * @param {Set<string>} selected
 * @param {Set<string>} known
 */
export function saveSelection(storage, selected, known) {
  try {
    storage?.setItem(STORAGE_KEY, JSON.stringify({ selected: [...selected], known: [...known] }));
  } catch {
    // storage full or disabled: the choice lasts for this visit only
  }
}

/** The page's localStorage, or null where it cannot be used (sandboxed frames). */
export function pageStorage() {
  try {
    return globalThis.localStorage ?? null;
  } catch {
    return null;
  }
}
