// View: the selected runs compared: one chart per tier overlaying every selected run's
// used bytes (each run in its selector color). Shown when more than one run is selected.

import { alignTo, TIERS, unionSteps } from '../data.js';
import { Chart } from './chart.js';
import { el } from './run_panel.js';

const HEIGHT = 200; // px

/** x = the union of the runs' steps; one used-bytes series per run, per tier. */
export function overlayData(runs, tier) {
  let x = [];
  for (const r of runs) x = unionSteps(x, r.tiers.steps);
  const series = runs.map((r) => ({
    label: r.run,
    values: alignTo(x, r.tiers.steps, r.tiers.values[tier]?.used_bytes ?? []),
    stroke: r.color,
    width: 1.5,
  }));
  return { x, series };
}

export class OverlayView {
  constructor() {
    this.element = el('section', 'mh-overlay');
    this.element.hidden = true;
    this.element.append(el('h2', 'mh-run-name', 'Selected runs: used bytes per tier'));
    const grid = el('div', 'mh-grid3');
    this.charts = new Map();
    for (const tier of TIERS) {
      const cell = el('div', 'mh-cell');
      cell.dataset.tier = tier;
      const box = el('div', 'mh-plot');
      cell.append(el('div', 'mh-cell-title', tier), box);
      grid.append(cell);
      this.charts.set(tier, new Chart(box, { height: HEIGHT, widthKey: 'overlay' }));
    }
    this.element.append(grid);
  }

  /** @param {Array<{run, color, tiers}>} runs (empty: hide the overlay) */
  update(runs) {
    this.element.hidden = runs.length < 2;
    this.element.dataset.runs = String(runs.length);
    if (runs.length < 2) return;
    for (const [tier, chart] of this.charts) {
      const { x, series } = overlayData(runs, tier);
      chart.update({ x, series, scales: { y: { unit: 'bytes' } }, markers: [] });
    }
  }

  resize() {
    if (!this.element.hidden) for (const chart of this.charts.values()) chart.resize();
  }
}
