// Pure data helpers shared by the views: no DOM, no fetching (tested with node --test).
// Data contract: /series answers (docs/http/series.md) are columnar arrays parallel to `steps`;
// null means "not measured" and is never turned into 0 here.

import { formatBytes } from './format.js';

export const TIERS = ['device', 'host', 'nvme'];

// Holders of a tier's bytes, bottom to top of the stack, with their tier-matrix column.
export const HOLDERS = [
  { key: 'param', column: 'param_bytes', label: 'param' },
  { key: 'grad', column: 'grad_bytes', label: 'grad' },
  { key: 'optimizer', column: 'optimizer_bytes', label: 'optimizer' },
  { key: 'other', column: 'other_bytes', label: 'other' },
];

// Readings drawn beside each tier's accounting (memory_hierarchy/readings columns).
export const TIER_READINGS = {
  device: [
    { column: 'framework_device_bytes', label: 'TensorFlow allocator in use (step end)' },
    { column: 'nvml_used_bytes', label: 'NVML used' },
  ],
  host: [{ column: 'process_rss_bytes', label: 'process RSS' }],
  nvme: [{ column: 'nvme_disk_bytes', label: 'on disk' }],
};

// In-step peaks drawn beside the step-boundary use: the pool's highest use since the
// previous record (tiers' peak_bytes) on every tier, and the framework allocator's peak
// (readings' framework_device_peak_bytes, reset after each record) on the device. They are
// never left off scale: the peak is what a budget must hold.
export const TIER_PEAKS = {
  device: [{ column: 'framework_device_peak_bytes', label: 'TensorFlow allocator peak (in step)', source: 'readings' }],
  host: [],
  nvme: [],
};

/**
 * What the tiers record's in-step peak (peak_bytes) of a tier measures, as a legend label.
 * Device at stage 3: the runtime's accounting of the device tier, the paged pool's pages
 * plus the reduced gradient shards TensorFlow holds beside them (stage3/telemetry.py);
 * device below stage 3: TensorFlow's allocator peak itself (the same figure as the
 * readings' line, so it is not drawn twice when readings exist).
 * @param {string} tier one of TIERS
 * @param {object|null} runInfo the latest run_info
 */
export function tierPeakLabel(tier, runInfo) {
  if (tier !== 'device') return 'in-step peak (runtime accounting)';
  return runInfo?.stage === 3 ? 'pool pages + gradient shards (in step)' : 'in-step peak';
}

/**
 * The device tier's figures, each named by what it measures: TensorFlow's
 * allocator in-step peak (the one measure the budget story compares with the device's
 * memory), the runtime's accounting peak (stage 3: pool pages + gradient shards), the
 * budget, the device's memory (run_info.device_capacity_bytes, the allocator's cap) and
 * whether the pool's own pages went over its budget (an overrun: accounting peak minus
 * the gradient shards and frozen weights outside the pool, above the budget).
 * @param {object} tiers a /series answer for memory_hierarchy/tiers
 * @param {object|null} readings a /series answer for memory_hierarchy/readings
 * @param {object|null} runInfo the latest run_info
 * @returns {{allocator: {value, step}|null, accounting: {value, step, grad}|null,
 *   budget: number|null, cap: number|null, stage3: boolean,
 *   overrun: {bytes, step}|null, outsidePool: number}} bytes
 */
export function deviceFigures(tiers, readings, runInfo) {
  const best = (steps, values) => {
    let out = null;
    (values ?? []).forEach((v, i) => {
      if (v !== null && !Number.isNaN(v) && (out === null || v > out.value)) out = { value: v, step: steps[i], index: i };
    });
    return out;
  };
  const cells = tiers?.values?.device ?? {};
  const steps = tiers?.steps ?? [];
  const allocator = readings ? best(readings.steps, readings.values.framework_device_peak_bytes) : null;
  const accounting = best(steps, cells.peak_bytes);
  const budget = maxOf(cells.capacity_bytes ?? []);
  const cap = typeof runInfo?.device_capacity_bytes === 'number' ? runInfo.device_capacity_bytes : null;
  const stage3 = runInfo?.stage === 3;
  let overrun = null;
  let outsidePool = 0;
  if (stage3 && budget !== null) {
    (cells.peak_bytes ?? []).forEach((peak, i) => {
      const capacity = cells.capacity_bytes?.[i];
      if (peak === null || capacity === null || capacity === undefined) return;
      const grad = cells.grad_bytes?.[i] ?? 0;
      outsidePool = Math.max(outsidePool, peak > capacity ? Math.min(grad, peak - capacity) : 0);
      const pool = peak - grad; // frozen weights (not in the pool) are counted as pool here
      if (pool > capacity && (overrun === null || pool - capacity > overrun.bytes)) {
        overrun = { bytes: pool - capacity, step: steps[i] };
      }
    });
  }
  return {
    allocator: allocator && { value: allocator.value, step: allocator.step },
    accounting: accounting && { value: accounting.value, step: accounting.step, grad: cells.grad_bytes?.[accounting.index] ?? null },
    budget,
    cap,
    stage3,
    overrun,
    outsidePool,
  };
}

// A reference line (capacity, reading) whose largest value exceeds this multiple of the
// tier's peak use is left out of the y-range and named "(off scale)" in the chart header.
export const OFF_SCALE_RATIO = 20;

export const DIRECTIONS = [
  { key: 'h2d', label: 'host→device' },
  { key: 'd2h', label: 'device→host' },
  { key: 'h2n', label: 'host→nvme' },
  { key: 'n2h', label: 'nvme→host' },
  // A clean page evicted to NVMe: its NVMe copy was current, so nothing is written.
  { key: 'h2n_clean', label: 'host→nvme clean (no write)' },
];

export const STEP_TIME_PARTS = [
  { column: 'step_seconds', label: 'step total' },
  { column: 'compute_seconds', label: 'compute' },
  { column: 'comm_seconds', label: 'communication' },
  { column: 'overlap_seconds', label: 'overlapped' },
  { column: 'stall_seconds', label: 'stall' },
];

/** True when at least one value was measured (not null/NaN). */
export function isMeasured(values) {
  return Array.isArray(values) && values.some((v) => v !== null && !Number.isNaN(v));
}

/** Largest measured value, or null when nothing was measured. */
export function maxOf(values) {
  let max = null;
  for (const v of values ?? []) {
    if (v !== null && !Number.isNaN(v) && (max === null || v > max)) max = v;
  }
  return max;
}

/** Last measured value (scanning back from the end), or null. */
export function lastMeasured(values) {
  for (let i = (values?.length ?? 0) - 1; i >= 0; i--) {
    if (values[i] !== null && !Number.isNaN(values[i])) return values[i];
  }
  return null;
}

/**
 * Sorted union of two ascending step arrays.
 * @param {number[]} a
 * @param {number[]} b
 */
export function unionSteps(a, b) {
  const out = [];
  let i = 0;
  let j = 0;
  while (i < a.length || j < b.length) {
    const x = j >= b.length || (i < a.length && a[i] <= b[j]) ? a[i] : b[j];
    if (i < a.length && a[i] === x) i++;
    if (j < b.length && b[j] === x) j++;
    out.push(x);
  }
  return out;
}

/**
 * Values of a series re-indexed onto `steps` (a superset of `srcSteps`); null elsewhere.
 * @param {number[]} steps ascending
 * @param {number[]} srcSteps ascending
 * @param {Array<number|null>} values parallel to srcSteps
 */
export function alignTo(steps, srcSteps, values) {
  if (steps === srcSteps) return values;
  const out = new Array(steps.length).fill(null);
  let j = 0;
  for (let i = 0; i < steps.length && j < srcSteps.length; i++) {
    if (steps[i] === srcSteps[j]) out[i] = values[j++] ?? null;
  }
  return out;
}

/**
 * Is a reference line off scale next to a tier's peak use?
 * @param {number|null} lineMax largest value of the line
 * @param {number|null} peakUse largest used bytes of the tier
 */
export function offScale(lineMax, peakUse) {
  if (lineMax === null) return false;
  if (!peakUse || peakUse <= 0) return lineMax > 0;
  return lineMax > OFF_SCALE_RATIO * peakUse;
}

/**
 * What to draw for one tier: the stacked holders, the used line, the capacity and the
 * readings (each either on scale or named off scale), and the y-range.
 * @param {object} tiers a /series answer for memory_hierarchy/tiers
 * @param {object|null} readings a /series answer for memory_hierarchy/readings
 * @param {string} tier one of TIERS
 * @returns {{steps, layers, used, lines, offScale, yMax, peakUse, holdersMeasured}}
 *   layers: [{key, label, raw, top}] bottom to top, `top` cumulative (for painting);
 *   lines: [{kind: 'capacity'|'reading', label, values}] on scale;
 *   offScale: [{label, value}] left out of the range (value: the line's largest value).
 */
export function tierPlot(tiers, readings, tier, runInfo = null) {
  const steps = readings ? unionSteps(tiers.steps, readings.steps) : tiers.steps;
  const cells = tiers.values[tier] ?? {};
  const col = (name) => alignTo(steps, tiers.steps, cells[name] ?? tiers.steps.map(() => null));
  const used = col('used_bytes');
  const peakUse = maxOf(used);
  const layers = [];
  let below = steps.map(() => null);
  for (const holder of HOLDERS) {
    const raw = col(holder.column);
    if (!isMeasured(raw)) continue;
    const top = raw.map((v, i) => (v === null ? below[i] : (below[i] ?? 0) + v));
    layers.push({ key: holder.key, label: holder.label, raw, top });
    below = top;
  }
  const capacityLabel =
    tier !== 'device' ? 'capacity' : runInfo?.stage === 3 ? 'pool budget (device_budget_bytes)' : 'device budget (device_budget_bytes)';
  const candidates = [{ kind: 'capacity', label: capacityLabel, values: col('capacity_bytes') }];
  if (tier === 'device' && typeof runInfo?.device_capacity_bytes === 'number') {
    // The device's memory: the limit TensorFlow's allocator enforces (the allocator cap
    // on the CPU stand-in), which the allocator peak is measured against.
    candidates.push({ kind: 'capacity', label: 'device memory (allocator limit)', values: steps.map(() => runInfo.device_capacity_bytes) });
  }
  for (const reading of readings ? TIER_READINGS[tier] : []) {
    const values = alignTo(steps, readings.steps, readings.values[reading.column] ?? []);
    candidates.push({ kind: 'reading', label: reading.label, values });
  }
  const peaks = [];
  const allocatorPeaks = readings ? TIER_PEAKS[tier] : [];
  const hasAllocator = allocatorPeaks.some((p) => isMeasured(readings.values[p.column]));
  // Below stage 3 the device's recorded peak is the allocator's own: drawn once.
  if (!(tier === 'device' && runInfo && runInfo.stage !== 3 && hasAllocator)) {
    peaks.push({ label: tierPeakLabel(tier, runInfo), values: col('peak_bytes') });
  }
  for (const peak of allocatorPeaks) {
    peaks.push({ label: peak.label, values: alignTo(steps, readings.steps, readings.values[peak.column] ?? []) });
  }
  const lines = [];
  const off = [];
  let yMax = Math.max(peakUse ?? 0, maxOf(below) ?? 0);
  let stepPeak = null;
  for (const peak of peaks) {
    const peakMax = maxOf(peak.values);
    if (peakMax === null) continue; // not measured: not drawn
    lines.push({ kind: 'peak', label: peak.label, values: peak.values, max: peakMax });
    yMax = Math.max(yMax, peakMax);
    stepPeak = Math.max(stepPeak ?? 0, peakMax);
  }
  // A reference line is off scale beside the largest figure drawn, the in-step peaks
  // included (the device's memory beside a 29 MiB allocator peak is on scale).
  const scale = Math.max(peakUse ?? 0, stepPeak ?? 0) || peakUse;
  for (const line of candidates) {
    const lineMax = maxOf(line.values);
    if (lineMax === null) continue; // not measured: not drawn
    if (offScale(lineMax, scale)) {
      off.push({ kind: line.kind, label: line.label, value: lineMax });
    } else {
      lines.push(line);
      yMax = Math.max(yMax, lineMax);
    }
  }
  return { steps, layers, used, lines, offScale: off, yMax, peakUse, stepPeak, holdersMeasured: layers.length > 0 };
}

/**
 * Prefetch hit rate per step: hits / (hits + misses); null when neither was counted.
 * @param {Array<number|null>} hits
 * @param {Array<number|null>} misses
 */
export function hitRate(hits, misses) {
  return hits.map((h, i) => {
    const m = misses[i];
    if (h === null || m === null || h + m === 0) return null;
    return h / (h + m);
  });
}

/**
 * A tunable or config value as text: byte keys (`…_bytes`) in binary units with the exact
 * count, other numbers as they are, null as "not set".
 * @param {string} key a config key
 * @param {unknown} value
 */
export function formatConfigValue(key, value) {
  if (value === null || value === undefined) return 'not set';
  if (typeof value === 'number' && key.endsWith('_bytes')) return formatBytes(value);
  if (Number.isInteger(value)) return groupDigits(value);
  return typeof value === 'string' ? value : JSON.stringify(value);
}

/** An integer with thousands separators: 1000000 -> "1,000,000". */
export function groupDigits(n) {
  return Number.isInteger(n) ? n.toLocaleString('en-US') : String(n);
}

/**
 * "key old → new, key old → new" of a runtime decision's `changes` ({key: {old, new}}).
 * @param {object|null} changes
 */
export function changesText(changes) {
  if (!changes || typeof changes !== 'object') return '';
  return Object.entries(changes)
    .map(([k, c]) => `${k} ${formatConfigValue(k, c?.old)} → ${formatConfigValue(k, c?.new)}`)
    .join(', ');
}

/** True for a runtime decision record ({version, status, step, changes, reason}). */
function isDecision(value) {
  return Boolean(value) && typeof value.status === 'string' && 'version' in value;
}

/**
 * The label of a config event: its `description`, else a runtime decision as
 * "v3 applied: key old → new" / "v4 rejected: reason", else "key: old → new", else JSON.
 * @param {object} value a memory_hierarchy/config_event record's value
 */
export function configLabel(value) {
  if (value && typeof value.description === 'string' && value.description) {
    return value.description;
  }
  if (isDecision(value)) {
    if (value.source === 'auto') {
      // The runtime's own headroom decision (device_budget_bytes='auto'): what and why.
      const text = changesText(value.changes);
      return `auto${text ? `: ${text}` : ''}${value.reason ? ` (${value.reason})` : ''}`;
    }
    const head = `v${value.version} ${value.status}`;
    if (value.status === 'applied') {
      const text = changesText(value.changes);
      return text ? `${head}: ${text}` : `v${value.version}: no change (values already in effect)`;
    }
    return value.reason ? `${head}: ${value.reason}` : head;
  }
  if (value && typeof value.key === 'string') {
    const change =
      'old' in value || 'new' in value
        ? `: ${JSON.stringify(value.old ?? null)} → ${JSON.stringify(value.new ?? null)}`
        : '';
    return `${value.key}${change}`;
  }
  return JSON.stringify(value);
}

/**
 * Every config event of a /json answer of memory_hierarchy/config_event, for the list:
 * `status` is the runtime's decision ('applied', 'rejected', 'ignored') or null for an
 * event that is not a decision (a change recorded some other way).
 * `version` and `source` ('user' or 'auto') are the decision's (null otherwise).
 * @returns {Array<{step: number, label: string, status: string|null, version: number|null,
 *   source: string|null}>}
 */
export function configEvents(answer) {
  return (answer?.events ?? []).map((e) => ({
    step: e.step,
    label: configLabel(e.value),
    status: isDecision(e.value) ? e.value.status : null,
    version: isDecision(e.value) ? e.value.version : null,
    source: isDecision(e.value) ? (e.value.source ?? 'user') : null,
  }));
}

/**
 * Markers for the charts: the config events that changed something (a rejected or
 * ignored request, or an applied one without changes, changes nothing, so it is listed
 * but not drawn). The label names each key and its old → new value; `version` is a user
 * request's (null otherwise), to attach its what-if prediction.
 * @returns {Array<{step: number, label: string, version: number|null}>}
 */
export function configMarkers(answer) {
  const changed = (v) => v.status === 'applied' && Object.keys(v.changes ?? {}).length > 0;
  return (answer?.events ?? [])
    .filter((e) => !isDecision(e.value) || changed(e.value))
    .map((e) => ({
      step: e.step,
      label: configLabel(e.value),
      version: isDecision(e.value) && (e.value.source ?? 'user') === 'user' ? e.value.version : null,
    }));
}

// -- checkpoints ------------------------------------------------------------------------

// 1 MB = 10^6 bytes: bandwidths are shown in decimal megabytes per second (MB/s).
export const BYTES_PER_MB = 1e6;

/**
 * The rows of the Checkpoints table from a GET /checkpoints answer, in step order:
 * `mbPerSecond` is the server's `bytes_per_second` (write bandwidth of a save, read
 * bandwidth of a restore) in MB/s (10^6 bytes/s), null when it was not measurable.
 * @param {{checkpoints?: object[]}|null} answer
 * @returns {Array<{step: number, op: string, tag: string, path: string|null,
 *   bytes: number|null, seconds: number|null, mbPerSecond: number|null}>}
 */
export function checkpointRows(answer) {
  const num = (v) => (typeof v === 'number' && Number.isFinite(v) ? v : null);
  return (answer?.checkpoints ?? []).map((c) => {
    const rate = num(c.bytes_per_second);
    return {
      step: c.step,
      op: String(c.op ?? ''),
      tag: String(c.tag ?? ''),
      path: c.path === null || c.path === undefined ? null : String(c.path),
      bytes: num(c.bytes),
      seconds: num(c.seconds),
      mbPerSecond: rate === null ? null : rate / BYTES_PER_MB,
    };
  });
}

/**
 * Chart markers (kind 'checkpoint') at the steps of a run's checkpoint saves and
 * restores; the records of one step share one marker, labelled
 * "save step00000015 (48 MiB), restore …".
 * @param {{checkpoints?: object[]}|null} answer a GET /checkpoints answer
 * @returns {Array<{step: number, label: string, kind: 'checkpoint'}>}
 */
export function checkpointMarkers(answer) {
  const byStep = new Map();
  for (const row of checkpointRows(answer)) {
    const text = `${row.op} ${row.tag} (${formatBytes(row.bytes)})`;
    byStep.set(row.step, [...(byStep.get(row.step) ?? []), text]);
  }
  return [...byStep].map(([step, texts]) => ({
    step,
    label: `checkpoint ${texts.join(', ')}`,
    kind: 'checkpoint',
  }));
}

// -- restarts -------------------------------------------------------------------------

/**
 * Chart markers at the steps a job resumed at after a restart, a preemption or a resize
 * (GET /restarts), kind 'restart' | 'preemption' | 'resize', labelled with the cause and
 * what it lost (the server's label).
 * @param {{markers?: object[]}|null} answer a GET /restarts answer
 * @returns {Array<{step: number, label: string, kind: string}>}
 */
export function restartMarkers(answer) {
  const kinds = new Set(['restart', 'preemption', 'resize']);
  return (answer?.markers ?? [])
    .filter((m) => Number.isInteger(m.step))
    .map((m) => ({
      step: m.step,
      label: String(m.label ?? ''),
      kind: kinds.has(m.kind) ? m.kind : 'restart',
    }));
}

/**
 * A job's goodput as the figures the view shows (null without one): the share of steps
 * kept (`useful_steps / all_steps`) and of wall time spent on kept steps
 * (`useful_seconds / wall_seconds`), with their parts.
 * @param {{goodput?: object|null}|null} answer a GET /restarts answer
 * @returns {{stepsRatio: number|null, usefulSteps: number|null, allSteps: number|null,
 *   timeRatio: number|null, usefulSeconds: number|null, wallSeconds: number|null}|null}
 */
export function goodputFigures(answer) {
  const g = answer?.goodput;
  if (!g || typeof g !== 'object') return null;
  const num = (v) => (typeof v === 'number' && Number.isFinite(v) ? v : null);
  return {
    stepsRatio: num(g.steps_ratio),
    usefulSteps: num(g.useful_steps),
    allSteps: num(g.all_steps),
    timeRatio: num(g.time_ratio),
    usefulSeconds: num(g.useful_seconds),
    wallSeconds: num(g.wall_seconds),
  };
}

// -- live tuning ------------------------------------------------------------------------

const BYTE_SUFFIXES = { b: 1, kib: 2 ** 10, mib: 2 ** 20, gib: 2 ** 30, tib: 2 ** 40, pib: 2 ** 50 };

/**
 * Parse what a user typed as a tunable's new value: an integer, and for a unit of bytes
 * optionally a binary suffix ("256 MiB", "1.5GiB" when that is a whole number of bytes).
 * Bounds are the server's to check (it names them in its answer).
 * @param {string} text
 * @param {string} unit the key's unit ('bytes', 'elements', 'steps')
 * @returns {{value: number}|{error: string}|null} null for an empty input
 */
export function parseTunableInput(text, unit) {
  const t = String(text ?? '').trim();
  if (!t) return null;
  const m = /^([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)$/.exec(t.replace(/[_,]/g, ''));
  if (!m) return { error: `"${t}" is not a whole number` };
  const suffix = m[2].toLowerCase();
  let factor = 1;
  if (suffix) {
    if (unit !== 'bytes' || !(suffix in BYTE_SUFFIXES)) {
      return { error: `"${t}": unknown unit "${m[2]}"` };
    }
    factor = BYTE_SUFFIXES[suffix];
  }
  const value = Number(m[1]) * factor;
  if (!Number.isSafeInteger(value)) return { error: `"${t}" is not a whole number of ${unit}` };
  return { value };
}

/**
 * The text of a live-tuning request's state (GET /tuning's `request`).
 * @param {object|null} request {state, version, step, changes, reason, requested_at}
 * @param {number} nowSeconds seconds since the epoch (for "pending for N s")
 */
export function tuningStateText(request, nowSeconds) {
  if (!request || request.state === 'none') return 'No live-tuning request yet.';
  const v = request.version === null || request.version === undefined ? '' : ` v${request.version}`;
  switch (request.state) {
    case 'pending': {
      const age =
        typeof request.requested_at === 'number'
          ? ` for ${Math.max(0, Math.round(nowSeconds - request.requested_at))} s`
          : '';
      return `Request${v}: pending${age}; the job applies it at its next step boundary.`;
    }
    case 'applied': {
      const text = changesText(request.changes);
      return `Request${v}: applied at step ${request.step}${text ? ` (${text})` : ' (no change)'}.`;
    }
    case 'rejected':
      return `Request${v}: rejected at step ${request.step}: ${request.reason ?? 'no reason given'}`;
    case 'ignored':
      return `Request${v}: ignored at step ${request.step}: ${request.reason ?? ''}`;
    default:
      return `Request${v}: ${request.state}`;
  }
}

/**
 * What the panel says after POST /tune answered: the version written and, for a worker of a
 * multi-worker job (`redirected`), that it went to the chief's run, which decides for the
 * whole job.
 * @param {object} answer POST /tune's answer {version, redirected, tuning_run}
 */
export function tuneWrittenText(answer) {
  const where = answer?.redirected
    ? ` to the chief\u2019s run ${answer.tuning_run} (it decides for every worker of the job)`
    : '';
  return `Request v${answer?.version} written${where}; waiting for the job.`;
}

// -- out-of-memory post-mortem -------------------------------------------------------------

/**
 * Every holder of every tier at the moment of failure, largest first.
 * @param {object} postmortem the memory_hierarchy/oom object (shared OOM contract)
 * @returns {Array<{tier, name, kind, bytes, pages}>}
 */
export function oomHolders(postmortem) {
  const rows = [];
  for (const [tier, info] of Object.entries(postmortem?.tiers ?? {})) {
    for (const h of info?.holders ?? []) {
      rows.push({
        tier,
        name: String(h?.name ?? ''),
        kind: String(h?.kind ?? 'other'),
        bytes: typeof h?.bytes === 'number' ? h.bytes : null,
        pages: typeof h?.pages === 'number' ? h.pages : null,
      });
    }
  }
  return rows.sort((a, b) => (b.bytes ?? -1) - (a.bytes ?? -1));
}

/**
 * The advice of a post-mortem, best first (rank 1 first; ties keep their order).
 * @param {object} postmortem
 */
export function rankedAdvice(postmortem) {
  const advice = Array.isArray(postmortem?.advice) ? postmortem.advice : [];
  return advice
    .map((a, index) => ({ a, index }))
    .sort((x, y) => (x.a?.rank ?? Infinity) - (y.a?.rank ?? Infinity) || x.index - y.index)
    .map((e) => e.a);
}

/**
 * Used and capacity bytes per tier over the flight recorder's last steps, columnar.
 * @param {object} postmortem
 * @returns {{steps: number[], tiers: Object<string, {used: Array, capacity: Array}>}}
 */
export function oomRecentSeries(postmortem) {
  const recent = Array.isArray(postmortem?.recent_steps) ? postmortem.recent_steps : [];
  const rows = recent.filter((r) => typeof r?.step === 'number').sort((a, b) => a.step - b.step);
  const steps = rows.map((r) => r.step);
  const tiers = {};
  for (const tier of TIERS) {
    const pick = (r, k) => {
      const v = r.tiers?.[tier]?.[k];
      return typeof v === 'number' ? v : null;
    };
    const used = rows.map((r) => pick(r, 'used_bytes'));
    if (!isMeasured(used)) continue;
    tiers[tier] = { used, capacity: rows.map((r) => pick(r, 'capacity_bytes')) };
  }
  return { steps, tiers };
}

/**
 * Predicted (estimate's per_process) versus measured (last step's used_bytes) per tier, and
 * the predicted in-step peak (estimate's per_process_peak) versus the measured one (the
 * last step's pool peak_bytes, or on the device the allocator peak when it is higher).
 * @param {object|null} estimate the latest memory_hierarchy/estimate value
 * @param {object|null} tiers a /series answer for memory_hierarchy/tiers
 * @param {object|null} [readings] a /series answer for memory_hierarchy/readings
 * @returns {Array<{tier, predicted, measured, ratio, predictedPeak, measuredPeak, peakRatio}>}
 *   null where unknown
 */
export function predictedVsMeasured(estimate, tiers, readings = null) {
  // The estimator predicts model states only (ZeRO, SC20, section 3.1), so the measured
  // side is the tier's param + grad + optimizer bytes, not its whole use (activations and
  // framework buffers are "other"); used_bytes stands in when no split was recorded.
  const perProcess = estimate?.per_process ?? {};
  const perProcessPeak = estimate?.per_process_peak ?? {};
  const last = tiers ? tiers.steps.length - 1 : -1;
  const lastReading = readings ? readings.steps.length - 1 : -1;
  const num = (v) => (typeof v === 'number' && !Number.isNaN(v) ? v : null);
  return TIERS.map((tier) => {
    const predicted = num(perProcess[`${tier}_bytes`]);
    const predictedPeak = num(perProcessPeak[`${tier}_bytes`]);
    const values = last >= 0 ? (tiers.values[tier] ?? {}) : {};
    const parts = ['param_bytes', 'grad_bytes', 'optimizer_bytes'].map((c) => values[c]?.[last]);
    let measured = null;
    if (parts.some((v) => typeof v === 'number')) {
      measured = parts.reduce((sum, v) => sum + (typeof v === 'number' ? v : 0), 0);
    } else if (last >= 0) {
      measured = values.used_bytes?.[last] ?? null;
    }
    const candidates = [{ value: num(values.peak_bytes?.[last]), source: tierPeakLabel(tier, null) }];
    for (const peak of TIER_PEAKS[tier]) {
      if (lastReading >= 0) candidates.push({ value: num(readings.values[peak.column]?.[lastReading]), source: peak.label });
    }
    const known = candidates.filter((c) => c.value !== null);
    const top = known.length ? known.reduce((a, b) => (b.value > a.value ? b : a)) : null;
    const measuredPeak = top ? top.value : null;
    // Which figure it is: the device's allocator peak or the runtime's accounting peak.
    const measuredPeakSource = top ? top.source : null;
    const ratio = predicted && measured !== null ? measured / predicted : null;
    const peakRatio = predictedPeak && measuredPeak !== null ? measuredPeak / predictedPeak : null;
    return { tier, predicted, measured, ratio, predictedPeak, measuredPeak, measuredPeakSource, peakRatio };
  });
}

// -- the placement table ---------------------------------------------------------------

export const PLACEMENT_COLUMNS = [
  { key: 'name', label: 'variable', type: 'text' },
  { key: 'shape', label: 'shape', type: 'shape' },
  { key: 'dtype', label: 'dtype', type: 'text' },
  { key: 'bytes', label: 'bytes', type: 'bytes' },
  { key: 'partitioning', label: 'partitioning', type: 'text' },
  { key: 'shard_bytes_per_replica', label: 'shard / replica', type: 'bytes' },
  { key: 'param_tier', label: 'param', type: 'text' },
  { key: 'grad_tier', label: 'grad', type: 'text' },
  { key: 'optimizer_tier', label: 'optimizer state', type: 'text' },
];

/** The text a placement cell shows (shape as "512×256", scalars as "scalar"). */
export function shapeText(shape) {
  if (!Array.isArray(shape)) return shape === undefined || shape === null ? '' : String(shape);
  return shape.length ? shape.join('×') : 'scalar';
}

function sortValue(row, column) {
  const v = row[column.key];
  if (column.type === 'shape') {
    return Array.isArray(v) ? v.reduce((a, b) => a * b, 1) : -1;
  }
  if (column.type === 'bytes') return typeof v === 'number' ? v : -1;
  return v === undefined || v === null ? '' : String(v);
}

/**
 * Placement rows sorted by one column (numbers numerically, text by locale), stable.
 * @param {object[]} rows
 * @param {string} key a PLACEMENT_COLUMNS key
 * @param {'asc'|'desc'} direction
 */
export function sortPlacement(rows, key, direction = 'asc') {
  const column = PLACEMENT_COLUMNS.find((c) => c.key === key) ?? PLACEMENT_COLUMNS[0];
  const sign = direction === 'desc' ? -1 : 1;
  return rows
    .map((row, index) => ({ row, index, value: sortValue(row, column) }))
    .sort((a, b) => {
      const cmp =
        typeof a.value === 'number' && typeof b.value === 'number'
          ? a.value - b.value
          : String(a.value).localeCompare(String(b.value));
      return cmp * sign || a.index - b.index;
    })
    .map((e) => e.row);
}

/**
 * Placement rows whose shown text contains every word of `query` (case-insensitive).
 * @param {object[]} rows
 * @param {string} query
 */
export function filterPlacement(rows, query) {
  const words = String(query ?? '').toLowerCase().split(/\s+/).filter(Boolean);
  if (!words.length) return rows;
  return rows.filter((row) => {
    const text = PLACEMENT_COLUMNS.map((c) =>
      c.type === 'shape' ? shapeText(row[c.key]) : String(row[c.key] ?? ''),
    )
      .join(' ')
      .toLowerCase();
    return words.every((w) => text.includes(w));
  });
}
