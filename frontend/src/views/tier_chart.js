// View: "Tier occupancy" of one run as small multiples, one chart per tier with its own
// y scale: the tier's bytes stacked by holder (param, grad, optimizer, other), the used
// line (at the step boundary), the in-step peaks (pool peak; on the device the allocator
// peak; dotted), the capacity line and the readings beside the accounting (dashed). A line more
// than OFF_SCALE_RATIO times the tier's peak use is left out of the range and named in the
// chart's header as "capacity X (off scale)".
// Data contract: /series answers for memory_hierarchy/tiers and memory_hierarchy/readings.

import { deviceFigures, maxOf, TIERS, tierPlot } from '../data.js';
import { formatBytes } from '../format.js';
import { deviceBudgetNote } from '../oom.js';
import { Chart } from './chart.js';
import { tierLabel } from './run_panel.js';

const HEIGHT = 220; // px
export const HOLDER_COLORS = {
  param: '#aecbfa',
  grad: '#fbc99a',
  optimizer: '#a8dab5',
  other: '#dadce0',
};
const USED_COLOR = '#202124';
const CAPACITY_COLOR = '#c5221f';
const PEAK_COLORS = ['#b80672', '#f29900']; // in-step peaks (runtime accounting, allocator)
const READING_COLORS = ['#9334e6', '#e37400'];

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

/** The header text of one tier's chart, e.g. "capacity 23.5 GiB (off scale)". */
export function tierHeaderNotes(plot, tier = null) {
  const notes = [`peak ${formatBytes(plot.peakUse)}`];
  if (tier === 'device') {
    // Each in-step peak named by what it measures (one figure, one name).
    for (const line of plot.lines.filter((l) => l.kind === 'peak')) notes.push(`${line.label} ${formatBytes(line.max)}`);
  } else if (plot.stepPeak !== null && plot.stepPeak !== undefined) {
    notes.push(`in-step peak ${formatBytes(plot.stepPeak)}`);
  }
  const capacities = plot.lines.filter((l) => l.kind === 'capacity');
  const capacity = capacities[0];
  if (tier === 'device') {
    for (const line of capacities) notes.push(`${line.label} ${formatBytes(maxOf(line.values))}`);
  } else if (capacity) {
    notes.push(`capacity ${formatBytes(maxOf(capacity.values))}`);
  }
  for (const line of plot.offScale) {
    notes.push(`${line.label} ${formatBytes(line.value)} (off scale)`);
  }
  const hasCapacity = capacity || plot.offScale.some((l) => l.kind === 'capacity');
  if (!hasCapacity) notes.push('capacity unbounded');
  return notes;
}

/** The chart spec (see chart.js) of one tier. */
export function tierSpec(plot, markers) {
  const series = [];
  // Painter's stacking: the top layer first, each filled down to 0, lower ones over it.
  for (const layer of [...plot.layers].reverse()) {
    series.push({
      label: layer.label,
      values: layer.top,
      stroke: HOLDER_COLORS[layer.key],
      fill: HOLDER_COLORS[layer.key],
      width: 1,
      legend: (idx) => formatBytes(layer.raw[idx]),
    });
  }
  series.push({ label: 'used', values: plot.used, stroke: USED_COLOR, width: 2 });
  let r = 0;
  let k = 0;
  for (const line of plot.lines) {
    if (line.kind === 'peak') {
      series.push({ label: line.label, values: line.values, stroke: PEAK_COLORS[k++ % PEAK_COLORS.length], width: 1.5, dash: [2, 3] });
      continue;
    }
    const isCapacity = line.kind === 'capacity';
    const isLimit = isCapacity && line.label.startsWith('device memory');
    series.push({
      label: line.label,
      values: line.values,
      stroke: isCapacity ? CAPACITY_COLOR : READING_COLORS[r++ % READING_COLORS.length],
      dash: isLimit ? [] : isCapacity ? [8, 4] : [4, 4],
      width: isCapacity ? 1.5 : 2,
    });
  }
  return {
    x: plot.steps,
    series,
    scales: { y: { unit: 'bytes', label: 'bytes on the tier', max: plot.yMax > 0 ? plot.yMax : 1024 } },
    markers,
  };
}

/** The three tier charts of one run; create once, then update with new data. */
export class TierCharts {
  /** @param {HTMLElement} container the run's `.mh-chart` element */
  constructor(container) {
    this.container = container;
    this.cells = new Map(); // tier -> {title, notes, chart}
    for (const tier of TIERS) {
      const cell = el('div', 'mh-tier-cell');
      cell.dataset.tier = tier;
      const head = el('div', 'mh-tier-head');
      const title = el('span', 'mh-tier-title', tier);
      const notes = el('span', 'mh-tier-notes');
      head.append(title, notes);
      const box = el('div', 'mh-plot');
      cell.append(head, box);
      // The device chart says what its budget bounds and what the allocator peak holds.
      const note = tier === 'device' ? el('p', 'mh-note mh-device-note') : null;
      if (note) {
        note.hidden = true;
        cell.append(note);
      }
      container.append(cell);
      this.cells.set(tier, { title, notes, note, chart: new Chart(box, { height: HEIGHT, widthKey: 'tier' }) });
    }
  }

  /**
   * Draw every tier. The container's data-* attributes expose what is drawn:
   * data-points, data-first-step, data-last-step (of the tiers series).
   * @param {object} tiers a /series answer for memory_hierarchy/tiers
   * @param {object|null} readings a /series answer for memory_hierarchy/readings
   * @param {object|null} runInfo the latest run_info (for the stand-in label)
   * @param {Array<{step, label}>} markers config changes
   * @param {(job: () => void) => Promise<void>|void} [run] runs each tier's drawing (a
   *   job); the view passes its scheduler (schedule.js), so one tier is one short task
   * @returns {Promise<void>} when every tier has drawn
   */
  async update(tiers, readings, runInfo, markers, run = (job) => job()) {
    for (const tier of TIERS) {
      await run(() => {
        const cell = this.cells.get(tier);
        const plot = tierPlot(tiers, readings, tier, runInfo);
        cell.title.textContent = tierLabel(tier, runInfo);
        cell.notes.textContent = tierHeaderNotes(plot, tier).join(' · ');
        if (cell.note) {
          const figures = deviceFigures(tiers, readings, runInfo);
          const text = deviceBudgetNote(runInfo, figures);
          cell.note.textContent = text ?? '';
          cell.note.hidden = !text;
          cell.note.dataset.overrun = figures.overrun ? 'true' : 'false';
          cell.note.classList.toggle('mh-overrun', Boolean(figures.overrun));
        }
        cell.chart.update(tierSpec(plot, markers));
      });
    }
    const n = tiers.steps.length;
    this.container.dataset.points = String(n);
    this.container.dataset.firstStep = n ? String(tiers.steps[0]) : '';
    this.container.dataset.lastStep = n ? String(tiers.steps[n - 1]) : '';
  }

  /** Fit the charts to their cells' widths. */
  resize() {
    for (const cell of this.cells.values()) cell.chart.resize();
  }
}
