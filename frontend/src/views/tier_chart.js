// View: the "Tier occupancy" chart of one run, drawn with uPlot.
// Data contract: a /series answer for memory_hierarchy/tiers (columnar arrays over steps,
// bytes, null where not measured). x is the step; y is bytes in binary units.

import uPlot from 'uplot';
import { byteTicks, formatBytes } from '../format.js';
import { TIERS, tierLabel } from './run_panel.js';

const COLORS = { device: '#e8710a', host: '#1a73e8', nvme: '#12a05c' };
const HEIGHT = 260; // px
const MIN_WIDTH = 320; // px
// Tick increments: whole steps (1, 2, 5, 10, ...) and bytes in powers of two, so the axis
// reads 512 MiB, 1 GiB, 2 GiB rather than 954 MiB, 1.86 GiB.
const STEP_INCRS = [];
for (let e = 0; e <= 12; e++) for (const m of [1, 2, 5]) STEP_INCRS.push(m * 10 ** e);
const BYTE_INCRS = Array.from({ length: 61 }, (_, k) => 2 ** k);

function chartWidth(container) {
  return Math.max(MIN_WIDTH, container.clientWidth || 0);
}

/** uPlot's aligned data: [steps, used per tier..., capacity per tier...]. */
export function alignedData(series) {
  const used = TIERS.map((t) => series.values[t]?.used_bytes ?? series.steps.map(() => null));
  const capacity = TIERS.map(
    (t) => series.values[t]?.capacity_bytes ?? series.steps.map(() => null),
  );
  return [series.steps, ...used, ...capacity];
}

function options(labels, width) {
  const bytes = (_u, v) => formatBytes(v);
  const used = TIERS.map((t, i) => ({
    label: `${labels[i]} used`,
    stroke: COLORS[t],
    width: 2,
    value: bytes,
  }));
  const capacity = TIERS.map((t, i) => ({
    label: `${labels[i]} capacity`,
    stroke: COLORS[t],
    width: 1,
    dash: [6, 4],
    points: { show: false },
    value: bytes,
  }));
  return {
    width,
    height: HEIGHT,
    scales: {
      x: { time: false },
      y: { range: (_u, _min, max) => [0, max > 0 ? max * 1.05 : 1] },
    },
    axes: [
      { label: 'step', incrs: STEP_INCRS },
      { label: 'bytes', values: byteTicks, incrs: BYTE_INCRS, size: 72 },
    ],
    series: [{ label: 'step' }, ...used, ...capacity],
    legend: { live: true },
  };
}

/** One run's tier-occupancy chart; create once, then update with new data. */
export class TierChart {
  /** @param {HTMLElement} container */
  constructor(container) {
    this.container = container;
    this.plot = null;
    this.labelsKey = '';
  }

  /**
   * Draw (or redraw) with a /series answer. The container's data-* attributes expose
   * what is drawn: data-points, data-first-step, data-last-step.
   * @param {object} series a /series answer for memory_hierarchy/tiers
   * @param {object|null} runInfo the latest run_info (for the stand-in label)
   */
  update(series, runInfo) {
    const labels = TIERS.map((t) => tierLabel(t, runInfo));
    const key = labels.join('|');
    const data = alignedData(series);
    if (this.plot && key === this.labelsKey) {
      this.plot.setData(data);
    } else {
      this.plot?.destroy();
      this.plot = new uPlot(options(labels, chartWidth(this.container)), data, this.container);
      this.labelsKey = key;
    }
    const n = series.steps.length;
    this.container.dataset.points = String(n);
    this.container.dataset.firstStep = n ? String(series.steps[0]) : '';
    this.container.dataset.lastStep = n ? String(series.steps[n - 1]) : '';
  }

  /** Fit the chart to its container's width. */
  resize() {
    this.plot?.setSize({ width: chartWidth(this.container), height: HEIGHT });
  }
}
