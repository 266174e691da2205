// Pure helpers of the OOM view and of the run's facts: the texts that say what each figure
// of a post-mortem measures (docs/oom.md), and the per-tier occupancy panels of its last
// steps. No DOM, no fetching (tested with node --test).
// Data contract: a post-mortem object as the runtime wrote it (GET /oom's `postmortem`).

import { formatBytes, formatPercent } from './format.js';

export const OOM_TIERS = ['device', 'host', 'nvme'];

// A capacity line more than this many times a panel's highest use is left off its scale
// and named in its header, so the used line is not flattened at zero.
export const OOM_OFF_SCALE_RATIO = 4;

const num = (v) => (typeof v === 'number' && Number.isFinite(v) ? v : null);

/**
 * The failed request in words: its bytes when known, otherwise why they are not known.
 * @param {object} pm a post-mortem
 * @returns {string} e.g. "1.5 MiB requested" or "no single request: ..."
 */
export function requestText(pm) {
  const fr = pm?.failed_request ?? {};
  const bytes = num(fr.bytes);
  if (bytes !== null && bytes > 0) return `${formatBytes(bytes)} requested`;
  if (typeof pm?.request_text === 'string' && pm.request_text) return pm.request_text;
  if (fr.error_type === 'DeviceBudgetExceededError') {
    return "no single request: the budget is checked at the step boundary, over the tier's whole use";
  }
  if (fr.error_type === 'HostMemoryLowError') {
    return "no single request: the machine's available memory fell below the margin";
  }
  return 'request size not known: the error named no tensor shape';
}

/**
 * The OOM view's first line.
 * @param {object} pm a post-mortem
 * @param {number} step the answer's step (when the post-mortem has none)
 * @param {string} tierName the failed tier's display name
 */
export function oomHeadline(pm, step, tierName) {
  return `Out of memory at step ${pm?.step ?? step} on ${tierName}: ${requestText(pm)}.`;
}

const CHECKED_WHO = {
  allocator: "TensorFlow's allocator",
  pool: 'the paged pool',
  accounting: 'the runtime’s accounting',
};

/**
 * What one tier row of a post-mortem says, as figures with what each measures.
 * @param {object} row a post-mortem tier row
 * @returns {{used: number|null, capacity: number|null, checked: number|null,
 *   source: string|null, share: number|null, text: string, checkedText: string|null}}
 *   `text` the bar's label ("44 MiB of 12 MiB (368%) by the runtime's accounting"),
 *   `checkedText` the checked figure when it differs ("TensorFlow's allocator read
 *   28 MiB at the check"), null otherwise
 */
export function oomTierFigures(row) {
  const used = num(row?.used_bytes);
  const capacity = num(row?.capacity_bytes);
  const checked = num(row?.checked_bytes);
  const source = typeof row?.checked_source === 'string' ? row.checked_source : null;
  const share = used !== null && capacity ? used / capacity : null;
  const pct = share === null ? '' : ` (${formatPercent(share)})`;
  const text =
    capacity === null
      ? `${formatBytes(used)} used (capacity unbounded)`
      : `${formatBytes(used)} of ${formatBytes(capacity)}${pct}`;
  let checkedText = null;
  if (checked !== null && checked !== used) {
    checkedText =
      source === 'allocator_peak'
        ? `TensorFlow’s allocator peaked at ${formatBytes(checked)} in the step, then refused the request`
        : `${CHECKED_WHO[source] ?? 'the check'} read ${formatBytes(checked)} at the check`;
  }
  return { used, capacity, checked, source, share, text, checkedText };
}

/**
 * The legend under the tier bars: what "used" and each checked figure measure, from the
 * post-mortem's own `figures` (reports without it: the older meaning, said so).
 * @param {object} pm a post-mortem
 * @returns {string[]}
 */
export function oomFigureNotes(pm) {
  const figures = pm?.figures;
  if (!figures || typeof figures !== 'object') {
    return ['Used: the tier’s bytes as the runtime recorded them (this report predates the explained figures).'];
  }
  const notes = [];
  if (typeof figures.used_bytes === 'string') notes.push(`Used: ${figures.used_bytes}.`);
  for (const [source, meaning] of Object.entries(figures.checked_bytes ?? {})) {
    notes.push(source === 'allocator_peak' ? `Allocator peak: ${meaning}.` : `Read at the check (${source}): ${meaning}.`);
  }
  return notes;
}

/**
 * One advice item's verdict in words, with the replayed bytes: "fits (predicted 9 MiB of
 * 12 MiB with the margin)", "may fit (...)", "does not fit (16 MiB over)". A budget raise
 * is measured against the raised budget (its change's value).
 * @param {object} a an advice row
 * @param {number|null} capacity the failed tier's capacity, bytes
 */
export function adviceVerdictText(a, capacity) {
  // A budget raise is replayed against the raised budget, not the one that failed.
  const raised = Object.entries(a?.change ?? {}).find(([k]) => k.endsWith('_budget_bytes'));
  if (raised && typeof raised[1] === 'number') capacity = raised[1];
  const known = ['fits', 'may fit', 'does not fit'];
  const verdict = known.includes(a?.verdict) ? a.verdict : a?.fits === true ? 'fits' : 'does not fit';
  const pred = num(a?.predicted_bytes);
  const missing = num(a?.missing_bytes);
  const of = capacity !== null && capacity !== undefined ? ` of ${formatBytes(capacity)}` : '';
  if (verdict === 'fits' && pred !== null) return `fits (predicted ${formatBytes(pred)}${of} with the margin)`;
  if (verdict === 'may fit') {
    if (pred === null && missing) return `may fit (${formatBytes(missing)} short of the margin)`;
    if (pred === null) return 'may fit (the bytes after the change are not known before it runs)';
    const tail = missing ? `, ${formatBytes(missing)} short of the margin` : '';
    return `may fit (predicted ${formatBytes(pred)}${of}: within the capacity${tail})`;
  }
  if (verdict === 'does not fit' && missing) return `does not fit (${formatBytes(missing)} over)`;
  return verdict;
}

/**
 * The last steps' occupancy as one panel per tier, each with its own scale: the used
 * line, and the capacity line unless it is more than OOM_OFF_SCALE_RATIO times the
 * panel's highest use (then it is named in `notes` instead).
 * @param {object} pm a post-mortem
 * @returns {{steps: number[], panels: Array<{tier, used: Array, capacity: Array|null,
 *   yMax: number, notes: string[]}>}} tiers never measured are left out
 */
export function oomRecentPanels(pm) {
  const recent = Array.isArray(pm?.recent_steps) ? pm.recent_steps : [];
  const rows = recent.filter((r) => typeof r?.step === 'number').sort((a, b) => a.step - b.step);
  const steps = rows.map((r) => r.step);
  const panels = [];
  for (const tier of OOM_TIERS) {
    const pick = (r, k) => num(r.tiers?.[tier]?.[k]);
    const used = rows.map((r) => pick(r, 'used_bytes'));
    if (!used.some((v) => v !== null)) continue;
    const capacity = rows.map((r) => pick(r, 'capacity_bytes'));
    const peak = Math.max(0, ...used.filter((v) => v !== null));
    const capMax = Math.max(0, ...capacity.filter((v) => v !== null));
    const notes = [`peak ${formatBytes(peak)}`];
    let shownCapacity = null;
    if (capMax === 0) {
      notes.push('capacity unbounded');
    } else if (capMax > OOM_OFF_SCALE_RATIO * peak) {
      notes.push(`capacity ${formatBytes(capMax)} (off scale)`);
    } else {
      shownCapacity = capacity;
      notes.push(`capacity ${formatBytes(capMax)}`);
    }
    const top = Math.max(peak, shownCapacity ? capMax : 0);
    panels.push({ tier, used, capacity: shownCapacity, yMax: top > 0 ? top * 1.3 : 1024, notes });
  }
  return { steps, panels };
}

/**
 * The badges beside a run's facts. Stage 0 is plain data parallelism, the baseline (not
 * a fallback); a ZeRO stage that fell back to the stock update is a fallback; the
 * stand-in badge is shown only when the device description does not already say so.
 * @param {object|null} runInfo the latest memory_hierarchy/run_info value
 * @param {string} standinLabel the stand-in's label
 * @returns {Array<{kind: 'standin'|'baseline'|'fallback', text: string}>}
 */
export function runBadges(runInfo, standinLabel) {
  if (!runInfo) return [];
  const badges = [];
  const description = String(runInfo.device_description ?? '');
  if (runInfo.device_is_standin === true && !description.includes('stand-in')) {
    badges.push({ kind: 'standin', text: standinLabel });
  }
  if (runInfo.stage === 0) {
    badges.push({ kind: 'baseline', text: 'plain data parallelism (stage 0, the baseline)' });
  } else if (runInfo.fallback_mirrored === true) {
    badges.push({
      kind: 'fallback',
      text: 'fallback: MirroredStrategy (model below mirrored_fallback_bytes)',
    });
  }
  return badges;
}

/**
 * What the device budget bounds and what the allocator peak includes, for the device
 * tier's chart (e.g. a 40 MiB allocator peak beside a 12 MiB budget), and, with the
 * run's figures (data.js deviceFigures), each in-step peak by what it measures: the
 * allocator peak (the one measure compared with the device's memory), the runtime's
 * accounting at stage 3 (pool pages + gradient shards, above the pool budget only by
 * the shards outside the pool, else flagged as an overrun).
 * @param {object|null} runInfo the latest run_info
 * @param {object|null} [figures] deviceFigures(tiers, readings, runInfo)
 * @returns {string|null} null without a run_info
 */
export function deviceBudgetNote(runInfo, figures = null) {
  if (!runInfo) return null;
  const config = runInfo.config && typeof runInfo.config === 'object' ? runInfo.config : null;
  const unset = config !== null && (config.device_budget_bytes === null || config.device_budget_bytes === undefined);
  const bounds = unset
    ? 'none is set (device_budget_bytes), so nothing bounds the tier but the hardware'
    : runInfo.stage === 3
      ? 'the budget bounds the paged pool’s device tier (gathered parameters), which the pool keeps within it by moving pages to host memory'
      : 'the budget is checked at each step boundary against the tier’s use (TensorFlow’s allocator reading when there is one, else the runtime’s accounting)';
  const standin =
    runInfo.device_is_standin === true
      ? ' On this machine the device is a budgeted stand-in: a region of host memory, no GPU.'
      : '';
  const pipeline = runInfo.device_is_standin === true ? ' and the input pipeline’s buffers (same host memory)' : '';
  const parts = [`Device budget: ${bounds}.${standin}`];
  const f = figures ?? {};
  if (f.allocator) {
    const limit =
      f.cap !== null && f.cap !== undefined
        ? `, against the device’s memory of ${formatBytes(f.cap)} (the allocator’s limit${runInfo.device_is_standin === true ? ', TF_CPU_BFC_MEM_LIMIT_IN_MB' : ''}): ` +
          (f.allocator.value > f.cap ? 'over it' : 'within it')
        : '';
    parts.push(
      `TensorFlow allocator peak (in step), the measure of the device’s memory: highest ` +
        `${formatBytes(f.allocator.value)} at step ${f.allocator.step}${limit}.`,
    );
  }
  parts.push(
    'The allocator peak is TensorFlow’s high-water mark inside a step, every tensor of every local replica: ' +
      `activations, gradients in flight, TensorFlow’s workspace${runInfo.stage === 3 ? ', the pool’s device pages' : ''}${pipeline}; ` +
      'the budget does not bound it.',
  );
  if (f.stage3 && f.accounting) {
    let text =
      `Pool pages + gradient shards (in step) is the runtime’s accounting of the device tier: the pool’s pages plus the ` +
      `reduced gradient shards TensorFlow holds beside them; highest ${formatBytes(f.accounting.value)} at step ${f.accounting.step}`;
    if (f.overrun) {
      text += `. OVERRUN: the pool’s own pages went over its budget by ${formatBytes(f.overrun.bytes)} at step ${f.overrun.step}.`;
    } else if (f.outsidePool > 0) {
      text +=
        `, above the pool budget by up to ${formatBytes(f.outsidePool)}: the gradient shards outside the pool, ` +
        'which the budget does not bound; the pool’s own pages stayed within it.';
    } else {
      text += ', within the pool budget.';
    }
    parts.push(text);
  }
  return parts.join(' ');
}
