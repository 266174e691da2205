// View: the selected runs compared: one chart per tier overlaying every selected run (each
// run in its selector color). Host and NVMe: used bytes. Device: one measure for every run:
// TensorFlow's allocator in-step peak when every run read it (the tiers
// record's device figures differ by stage: the allocator below stage 3, the pool's
// accounting at stage 3), else used bytes, and the chart's title says which.
// Shown when more than one run is selected.

import { alignTo, isMeasured, TIERS, unionSteps } from '../data.js';
import { Chart } from './chart.js';
import { el } from './run_panel.js';

const HEIGHT = 200; // px
const ALLOCATOR_PEAK = 'framework_device_peak_bytes';

/** True when every run read TensorFlow's allocator peak (the device's common measure). */
export function allocatorForAll(runs) {
  return runs.length > 0 && runs.every((r) => r.readings && isMeasured(r.readings.values?.[ALLOCATOR_PEAK]));
}

/** The title of one tier's overlay chart: what its lines measure. */
export function overlayTitle(runs, tier) {
  if (tier !== 'device') return `${tier}: used bytes`;
  return allocatorForAll(runs)
    ? 'device: TensorFlow allocator peak (in step), the same measure for every run'
    : 'device: used bytes (each run’s own reading: not one measure across stages)';
}

/**
 * x = the union of the runs' steps; one series per run, per tier (see overlayTitle). On
 * the device by the allocator peak, a run that ran out of memory also gets its failed
 * step's peak (the post-mortem's reading, `oomPeak`), which no record holds, and says so.
 */
export function overlayData(runs, tier) {
  const allocator = tier === 'device' && allocatorForAll(runs);
  const withOom = (r) => {
    const steps = [...r.readings.steps];
    const values = [...(r.readings.values[ALLOCATOR_PEAK] ?? [])];
    if (r.oomPeak && !steps.includes(r.oomPeak.step)) {
      const i = steps.findIndex((s) => s > r.oomPeak.step);
      const at = i < 0 ? steps.length : i;
      steps.splice(at, 0, r.oomPeak.step);
      values.splice(at, 0, r.oomPeak.value);
    }
    return { steps, values };
  };
  const device = allocator ? runs.map(withOom) : null;
  let x = [];
  runs.forEach((r, k) => {
    x = unionSteps(x, allocator ? device[k].steps : r.tiers.steps);
  });
  const series = runs.map((r, k) => ({
    label: allocator && r.oomPeak ? `${r.run} (out of memory at step ${r.oomPeak.step})` : r.run,
    values: allocator
      ? alignTo(x, device[k].steps, device[k].values)
      : alignTo(x, r.tiers.steps, r.tiers.values[tier]?.used_bytes ?? []),
    stroke: r.color,
    width: 1.5,
  }));
  return { x, series };
}

export class OverlayView {
  constructor() {
    this.element = el('section', 'mh-overlay');
    this.element.hidden = true;
    this.element.append(el('h2', 'mh-run-name', 'Selected runs compared, per tier'));
    const grid = el('div', 'mh-grid3');
    this.charts = new Map();
    this.titles = new Map();
    for (const tier of TIERS) {
      const cell = el('div', 'mh-cell');
      cell.dataset.tier = tier;
      const box = el('div', 'mh-plot');
      const title = el('div', 'mh-cell-title', tier);
      cell.append(title, box);
      grid.append(cell);
      this.titles.set(tier, title);
      this.charts.set(tier, new Chart(box, { height: HEIGHT, widthKey: 'overlay' }));
    }
    this.element.append(grid);
  }

  /** @param {Array<{run, color, tiers, readings}>} runs (empty: hide the overlay) */
  update(runs) {
    this.element.hidden = runs.length < 2;
    this.element.dataset.runs = String(runs.length);
    if (runs.length < 2) return;
    for (const [tier, chart] of this.charts) {
      this.titles.get(tier).textContent = overlayTitle(runs, tier);
      const { x, series } = overlayData(runs, tier);
      chart.update({ x, series, scales: { y: { unit: 'bytes' } }, markers: [] });
    }
  }

  resize() {
    if (!this.element.hidden) for (const chart of this.charts.values()) chart.resize();
  }
}
