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
