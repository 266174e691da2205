// What-if (GET /whatif, and the predictions of GET /tuning): a proposed live-tuning
// change's predicted effect, from the job's recorded access trace replayed through the
// pool's own policy code (docs/tuning.md, "What-if before apply"), and, once applied,
// predicted beside measured. Pure functions from answers to rows and sentences.

import { formatBytes } from './format.js';

const MOVE_ROWS = [
  ['d2h', 'page moves per step, device \u2192 host'],
  ['h2d', 'page moves per step, host \u2192 device'],
  ['h2n', 'page moves per step, host \u2192 NVMe'],
  ['n2h', 'page moves per step, NVMe \u2192 host'],
  ['h2n_clean', 'page moves per step, host \u2192 NVMe clean (no write)'],
];

function num(value, digits = 1) {
  if (value === null || value === undefined || Number.isNaN(value)) return '\u2014';
  return Number.isInteger(value) ? String(value) : value.toFixed(digits);
}

function seconds(value) {
  if (value === null || value === undefined) return 'unknown';
  return value < 1 ? `${(value * 1000).toFixed(1)} ms` : `${value.toFixed(2)} s`;
}

/**
 * The table of a /whatif answer: one row per figure, the pool's recorded steps' mean (now),
 * the predicted steady steps' mean, and the whole run's recorded figure over the same
 * steps (`run_recorded`: what the Page moves and tiers panels show, other pools such as
 * the NVMe optimizer-state store included; '—' where it has none).
 * @param {object} answer GET /whatif's answer with available true
 * @returns {Array<{key: string, label: string, now: string, predicted: string, whole: string,
 *   nowValue: number|null, predictedValue: number|null, wholeValue: number|null}>}
 */
export function whatifRows(answer) {
  const now = answer?.recorded ?? {};
  const pred = answer?.predicted?.steady ?? {};
  const whole = answer?.run_recorded ?? {};
  const rows = MOVE_ROWS.map(([d, label]) => ({
    key: `moves_${d}`,
    label,
    nowValue: now.moves_per_step?.[d] ?? null,
    predictedValue: pred.moves_per_step?.[d] ?? null,
    wholeValue: whole.moves_per_step?.[d] ?? null,
  }));
  for (const [key, label, tier, field] of [
    ['device_peak', 'pool device peak (the pool\u2019s pages only)', 'device', 'peak_bytes'],
    ['host_peak', 'host peak (pool pages)', 'host', 'peak_bytes'],
    ['nvme_used', 'NVMe in use', 'nvme', 'used_bytes'],
  ]) {
    rows.push({
      key,
      label,
      nowValue: now[field]?.[tier] ?? null,
      predictedValue: pred[field]?.[tier] ?? null,
      wholeValue: key === 'nvme_used' ? (whole.nvme_used_bytes ?? null) : null,
      bytes: true,
    });
  }
  rows.push({
    key: 'misses',
    label: 'prefetch misses per step (pages)',
    nowValue: now.prefetch_misses ?? null,
    predictedValue: pred.prefetch_misses ?? null,
    wholeValue: whole.prefetch_misses ?? null,
  });
  rows.push({
    key: 'stall',
    label: 'stall per step (predicted: misses \u00d7 the recorded stall per miss)',
    nowValue: now.stall_seconds ?? null,
    predictedValue: pred.stall_seconds ?? null,
    wholeValue: whole.stall_seconds ?? null,
    seconds: true,
  });
  const show = (r, v) => {
    if (r.bytes) return v === null ? '—' : formatBytes(v);
    if (r.seconds) return v === null ? '—' : seconds(v);
    return num(v);
  };
  return rows.map((r) => ({
    ...r,
    wholeValue: r.wholeValue ?? null,
    now: r.bytes ? formatBytes(r.nowValue) : r.seconds ? seconds(r.nowValue) : num(r.nowValue),
    predicted: r.bytes
      ? formatBytes(r.predictedValue)
      : r.seconds
        ? seconds(r.predictedValue)
        : num(r.predictedValue),
    whole: show(r, r.wholeValue ?? null),
  }));
}

/**
 * The sentence under the what-if headline: what the replay covers (`scope`) and the
 * page moves per step the run recorded outside it over the same steps (the whole run's
 * `run_recorded` minus the pool's `recorded`), so the "pool now" column and the Page
 * moves panel do not silently disagree.
 * @param {object} answer GET /whatif's answer with available true
 */
export function whatifScope(answer) {
  if (!answer?.available || !answer.scope) return '';
  const head = `Replayed: ${answer.scope}.`;
  const whole = totalMoves(answer.run_recorded);
  const pool = totalMoves(answer.recorded);
  if (whole === null || pool === null) return head;
  const outside = Math.max(0, whole - pool);
  return (
    `${head} Over these steps the whole run recorded ${num(whole)} page moves per step ` +
    `(Page moves panel), the pool ${num(pool)}: ${num(outside)} per step are outside the replay ` +
    'and stay as recorded.'
  );
}

/** Page moves per step in all directions of a summary (null when absent). */
export function totalMoves(summary) {
  const m = summary?.moves_per_step;
  return m ? Object.values(m).reduce((a, b) => a + b, 0) : null;
}

/**
 * The sentence above the what-if table.
 * @param {object} answer GET /whatif's answer
 */
export function whatifHeadline(answer) {
  if (!answer) return '';
  if (!answer.available) return `No prediction: ${answer.reason}`;
  const steps = answer.steps ?? [];
  const span = steps.length > 1 ? `steps ${steps[0]}\u2013${steps[steps.length - 1]}` : `step ${steps[0]}`;
  if (answer.oom) {
    const first = String(answer.oom.message ?? '').split('\n')[0];
    return `Predicted from ${span} replayed: the job would run out of memory at step ${answer.oom.step} (${first}).`;
  }
  const now = totalMoves(answer.recorded);
  const pred = totalMoves(answer.predicted?.steady);
  const peakNow = answer.recorded?.peak_bytes?.device;
  const peakPred = answer.predicted?.steady?.peak_bytes?.device;
  return (
    `Predicted from ${span} replayed through the pool's policy: page moves ${num(now)} \u2192 ` +
    `${num(pred)} per step; pool device peak ${formatBytes(peakNow)} \u2192 ${formatBytes(peakPred)}.`
  );
}

function errorText(predicted, measured) {
  if (predicted === null || measured === null || predicted === undefined || measured === undefined) {
    return '';
  }
  if (measured === 0) return predicted === 0 ? ' (exact)' : '';
  const pct = ((predicted - measured) / measured) * 100;
  return ` (${pct >= 0 ? '+' : ''}${pct.toFixed(0)}%)`;
}

/**
 * One stored prediction beside what the job measured (GET /tuning's `predictions` item).
 * @param {object} o {version, applied_step, predicted, measured, oom}
 */
export function outcomeText(o) {
  const pred = o.predicted ?? {};
  const head = `v${o.version}`;
  if (o.oom) return `${head}: predicted to run out of memory at step ${o.oom.step}.`;
  const predicted = `page moves ${num(pred.moves_total)} per step, pool device peak ${formatBytes(pred.device_peak_bytes)}`;
  if (o.applied_step === null || o.applied_step === undefined) {
    return `${head}: predicted ${predicted}; not applied yet.`;
  }
  if (!o.measured) return `${head} (applied at step ${o.applied_step}): predicted ${predicted}; measured: waiting for a step.`;
  const m = o.measured;
  return (
    `${head} (applied at step ${o.applied_step}): page moves per step predicted ` +
    `${num(pred.moves_total)}, measured ${num(m.moves_total)}${errorText(pred.moves_total, m.moves_total)}; ` +
    `pool device peak predicted ${formatBytes(pred.device_peak_bytes)}, measured ` +
    `${formatBytes(m.device_peak_bytes)}${errorText(pred.device_peak_bytes, m.device_peak_bytes)}.`
  );
}

/** The short text a config marker gets: predicted beside measured page moves. */
export function markerWhatifText(o) {
  if (!o?.measured) return o ? `predicted ${num(o.predicted?.moves_total)} page moves/step` : '';
  return (
    `page moves/step predicted ${num(o.predicted?.moves_total)}, measured ${num(o.measured.moves_total)}; ` +
    `pool device peak predicted ${formatBytes(o.predicted?.device_peak_bytes)}, measured ${formatBytes(o.measured.device_peak_bytes)}`
  );
}
