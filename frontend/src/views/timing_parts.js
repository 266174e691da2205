// The step-time breakdown's parts and its traced (compile) steps, from a
// memory_hierarchy/timing series; pure functions (no DOM), shared by the timing view and
// its unit tests.

import { STEP_TIME_PARTS } from '../data.js';

/** The breakdown's parts: the shared step-time parts and the NVMe I/O seconds. */
export const TIMING_PARTS = [...STEP_TIME_PARTS, { column: 'io_seconds', label: 'NVMe I/O' }];

/**
 * Steps that traced the step function, and the y-range top of the others.
 * @param {{steps: number[], values: object}} series a memory_hierarchy/timing series
 * @param {string[]} columns the drawn columns
 * @returns {{traced: Array<{step: number, seconds: number|null}>, top: number|null}}
 *   `top` is the largest drawn value over the untraced steps (null: no such value, or no
 *   step traced, so the chart scales to all of them)
 */
export function tracedSteps(series, columns) {
  const flags = series.values.traced ?? [];
  const traced = [];
  let top = null;
  series.steps.forEach((step, i) => {
    if (flags[i] > 0) {
      traced.push({ step, seconds: series.values.step_seconds?.[i] ?? null });
      return;
    }
    for (const column of columns) {
      const v = series.values[column]?.[i];
      if (v !== null && v !== undefined && !Number.isNaN(v) && (top === null || v > top)) top = v;
    }
  });
  return { traced, top: traced.length ? top : null };
}

