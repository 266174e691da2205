// Pure helpers of the "Compare runs" view (GET /diff, docs/http/reports.md): which two runs
// are compared by default, and what the tier-difference charts and the placement diff
// table show. No DOM; tested by `npm test`.

import { byRecency } from './selection.js';

export const DIFF_TIERS = ['device', 'host', 'nvme'];

/**
 * The default pair [A, B]: the two most recent selected runs, B the newer; when fewer
 * than two runs are selected, the most recent listed runs fill in. null with < 2 runs.
 * @param {string[]} runs every listed run
 * @param {Set<string>} selected
 * @param {Map<string, number>} recency run -> seconds since the epoch
 * @returns {[string, string]|null}
 */
export function defaultPair(runs, selected, recency) {
  const ordered = byRecency(runs, recency);
  const picks = ordered.filter((r) => selected.has(r)).slice(0, 2);
  for (const r of ordered) {
    if (picks.length >= 2) break;
    if (!picks.includes(r)) picks.push(r);
  }
  return picks.length === 2 ? [picks[1], picks[0]] : null;
}

/**
 * Keep the user's pair while both runs are still listed and distinct, else the default.
 * @param {[string, string]|null} current
 * @param {string[]} runs
 * @param {Set<string>} selected
 * @param {Map<string, number>} recency
 */
export function keepOrDefaultPair(current, runs, selected, recency) {
  if (current && current[0] !== current[1] && current.every((r) => runs.includes(r))) {
    return current;
  }
  return defaultPair(runs, selected, recency);
}

/**
 * The chart of one tier: x = the compared steps; Δ used and Δ peak (B − A, bytes).
 * @param {object} answer a /diff answer
 * @param {string} tier
 */
export function tierDiffSeries(answer, tier) {
  return {
    x: answer.steps,
    used: answer.values[`${tier}/used_bytes`] ?? [],
    peak: answer.values[`${tier}/peak_bytes`] ?? [],
  };
}

/** The last measured (non-null) value of a series, or null. */
export function lastValue(values) {
  for (let i = (values?.length ?? 0) - 1; i >= 0; i--) {
    const v = values[i];
    if (v !== null && v !== undefined && Number.isFinite(v)) return v;
  }
  return null;
}

/** Whether a tier has any measured difference (all null: the chart says so instead). */
export function hasValues(values) {
  return lastValue(values) !== null;
}

/**
 * The text of a placement cell of one side: tiers "param / grad / optimizer", the
 * partitioning, or "—" for a variable the run does not have.
 * @param {object|null} side the row's `a` or `b`
 * @param {'tiers'|'partitioning'|'optimizer_tier'} what
 */
export function placementSideText(side, what) {
  if (!side) return '—';
  if (what === 'tiers') return [side.param_tier, side.grad_tier].map((t) => t ?? '—').join(' / ');
  const v = side[what];
  return v === null || v === undefined ? '—' : String(v);
}
