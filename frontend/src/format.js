// Number formatting shared by the views. Pure functions, no DOM.

const BYTE_UNITS = ['B', 'KiB', 'MiB', 'GiB', 'TiB', 'PiB'];

/**
 * Human-readable bytes in binary units, three significant digits: 1536 -> "1.5 KiB".
 * @param {number|null|undefined} bytes
 * @returns {string} "—" when the value was not measured (null or NaN).
 */
export function formatBytes(bytes) {
  if (bytes === null || bytes === undefined || Number.isNaN(bytes)) return '—';
  const sign = bytes < 0 ? '-' : '';
  let value = Math.abs(bytes);
  let unit = 0;
  while (value >= 1024 && unit < BYTE_UNITS.length - 1) {
    value /= 1024;
    unit += 1;
  }
  const digits = unit === 0 || value >= 100 ? 0 : value >= 10 ? 1 : 2;
  let text = value.toFixed(digits);
  if (digits > 0) text = text.replace(/\.?0+$/, ''); // 1.50 -> 1.5, 4.00 -> 4
  return `${sign}${text} ${BYTE_UNITS[unit]}`;
}

/**
 * Axis ticks in bytes: uPlot's `axes[].values` callback.
 * @param {unknown} _u the uPlot instance (unused)
 * @param {number[]} splits tick values in bytes
 * @returns {string[]}
 */
export function byteTicks(_u, splits) {
  return splits.map((v) => formatBytes(v));
}

/**
 * Seconds with a unit that fits: 0.0021 -> "2.1 ms", 1.5 -> "1.5 s".
 * @param {number|null|undefined} seconds
 * @returns {string} "—" when not measured.
 */
export function formatSeconds(seconds) {
  if (seconds === null || seconds === undefined || Number.isNaN(seconds)) return '—';
  const abs = Math.abs(seconds);
  if (abs === 0) return '0 s';
  const [value, unit] = abs < 1e-3 ? [seconds * 1e6, 'µs'] : abs < 1 ? [seconds * 1e3, 'ms'] : [seconds, 's'];
  return `${trim(value)} ${unit}`;
}

/**
 * A ratio in [0, 1] as a percentage: 0.75 -> "75%".
 * @param {number|null|undefined} ratio
 */
export function formatPercent(ratio) {
  if (ratio === null || ratio === undefined || Number.isNaN(ratio)) return '—';
  return `${trim(ratio * 100)}%`;
}

/**
 * A count: whole numbers as they are, fractions to three significant digits.
 * @param {number|null|undefined} count
 */
export function formatCount(count) {
  if (count === null || count === undefined || Number.isNaN(count)) return '—';
  return Number.isInteger(count) ? String(count) : trim(count);
}

/**
 * A bandwidth in MB/s (10^6 bytes per second) with one decimal: 201.326592 -> "201.3".
 * @param {number|null|undefined} mbPerSecond
 * @returns {string} "—" when not measured.
 */
export function formatMbPerSecond(mbPerSecond) {
  if (mbPerSecond === null || mbPerSecond === undefined || Number.isNaN(mbPerSecond)) return '—';
  return mbPerSecond.toFixed(1);
}

function trim(value) {
  const abs = Math.abs(value);
  const digits = abs >= 100 ? 0 : abs >= 10 ? 1 : 2;
  let text = value.toFixed(digits);
  if (digits > 0) text = text.replace(/\.?0+$/, '');
  return text;
}

/** Axis ticks in seconds (uPlot `axes[].values`). */
export function secondTicks(_u, splits) {
  return splits.map((v) => formatSeconds(v));
}

/** Axis ticks as percentages of a [0, 1] ratio (uPlot `axes[].values`). */
export function percentTicks(_u, splits) {
  return splits.map((v) => formatPercent(v));
}
