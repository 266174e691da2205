// Pure data helpers shared by the views: no DOM, no fetching (tested with node --test).
// Data contract: /series answers (docs/http_api.md) are columnar arrays parallel to `steps`;
// null means "not measured" and is never turned into 0 here.

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
    { column: 'framework_device_bytes', label: 'framework allocator' },
    { column: 'nvml_used_bytes', label: 'NVML used' },
  ],
  host: [{ column: 'process_rss_bytes', label: 'process RSS' }],
  nvme: [{ column: 'nvme_disk_bytes', label: 'on disk' }],
};

// A reference line (capacity, reading) whose largest value exceeds this multiple of the
// tier's peak use is left out of the y-range and named "(off scale)" in the chart header.
export const OFF_SCALE_RATIO = 20;

export const DIRECTIONS = [
  { key: 'h2d', label: 'host→device' },
  { key: 'd2h', label: 'device→host' },
  { key: 'h2n', label: 'host→nvme' },
  { key: 'n2h', label: 'nvme→host' },
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
export function tierPlot(tiers, readings, tier) {
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
  const candidates = [{ kind: 'capacity', label: 'capacity', values: col('capacity_bytes') }];
  for (const reading of readings ? TIER_READINGS[tier] : []) {
    const values = alignTo(steps, readings.steps, readings.values[reading.column] ?? []);
    candidates.push({ kind: 'reading', label: reading.label, values });
  }
  const lines = [];
  const off = [];
  let yMax = Math.max(peakUse ?? 0, maxOf(below) ?? 0);
  for (const line of candidates) {
    const lineMax = maxOf(line.values);
    if (lineMax === null) continue; // not measured: not drawn
    if (offScale(lineMax, peakUse)) {
      off.push({ kind: line.kind, label: line.label, value: lineMax });
    } else {
      lines.push(line);
      yMax = Math.max(yMax, lineMax);
    }
  }
  return { steps, layers, used, lines, offScale: off, yMax, peakUse, holdersMeasured: layers.length > 0 };
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
 * The label of a config event: its `description`, else "key: old → new", else its JSON.
 * @param {object} value a memory_hierarchy/config_event record's value
 */
export function configLabel(value) {
  if (value && typeof value.description === 'string' && value.description) {
    return value.description;
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
 * Markers for the charts from a /json answer of memory_hierarchy/config_event.
 * @returns {Array<{step: number, label: string}>}
 */
export function configMarkers(answer) {
  return (answer?.events ?? []).map((e) => ({ step: e.step, label: configLabel(e.value) }));
}

/**
 * Predicted (estimate's per_process) versus measured (last step's used_bytes) per tier.
 * @param {object|null} estimate the latest memory_hierarchy/estimate value
 * @param {object|null} tiers a /series answer for memory_hierarchy/tiers
 * @returns {Array<{tier, predicted, measured, ratio}>} null where unknown
 */
export function predictedVsMeasured(estimate, tiers) {
  const perProcess = estimate?.per_process ?? {};
  const last = tiers ? tiers.steps.length - 1 : -1;
  return TIERS.map((tier) => {
    const p = perProcess[`${tier}_bytes`];
    const predicted = typeof p === 'number' ? p : null;
    const measured = last >= 0 ? (tiers.values[tier]?.used_bytes?.[last] ?? null) : null;
    const ratio = predicted && measured !== null ? measured / predicted : null;
    return { tier, predicted, measured, ratio };
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
