// View: step-time breakdown of one run (compute, communication, overlapped, stall, NVMe
// I/O and the whole step) and the overlap ratio (memory_hierarchy/timing). A part that was
// never measured is named "not measured", never drawn as zero. Steps that traced (compiled)
// the step function (column `traced`) are drawn but kept out of the y-range, with a marker.

import { isMeasured } from '../data.js';
import { formatPercent, formatSeconds } from '../format.js';
import { Chart } from './chart.js';
import { TIMING_PARTS, tracedSteps } from './timing_parts.js';
import { el, renderNote, renderSummary } from './run_panel.js';

const HEIGHT = 180; // px
const PART_COLORS = {
  step_seconds: '#202124',
  compute_seconds: '#1a73e8',
  comm_seconds: '#e8710a',
  overlap_seconds: '#12a05c',
  stall_seconds: '#c5221f',
  io_seconds: '#9334e6',
};

/** The summary items of the last step (see renderSummary). */
export function timingSummaryItems(series) {
  const last = series.steps.length - 1;
  const v = (column) => series.values[column]?.[last] ?? null;
  const items = TIMING_PARTS.map((p) => ({
    metric: p.column,
    label: p.label,
    value: v(p.column),
    text: formatSeconds(v(p.column)),
  }));
  const ratio = v('overlap_ratio');
  items.push({ metric: 'overlap_ratio', label: 'overlap ratio', value: ratio, text: formatPercent(ratio) });
  return items;
}

/** The step-time view of one run; create once, then update. */
export class TimingView {
  /** @param {HTMLElement} body the section's body */
  constructor(body) {
    this.body = body;
    this.parts = null;
  }

  build() {
    const summary = el('p', 'mh-summary');
    const missing = el('p', 'mh-missing');
    const grid = el('div', 'mh-grid2');
    const make = (title) => {
      const cell = el('div', 'mh-cell');
      const box = el('div', 'mh-plot');
      const note = el('p', 'mh-note');
      note.hidden = true;
      cell.append(el('div', 'mh-cell-title', title), note, box);
      grid.append(cell);
      return { chart: new Chart(box, { height: HEIGHT, widthKey: 'grid2' }), note, box };
    };
    const breakdown = make('Step-time breakdown');
    const ratio = make('Overlap ratio (overlapped / communication)');
    this.body.replaceChildren(summary, missing, grid);
    this.parts = { summary, missing, breakdown, ratio };
  }

  /**
   * @param {object|null} series a /series answer for memory_hierarchy/timing (null: none)
   * @param {Array<{step, label}>} markers
   */
  update(series, markers) {
    if (!series || !series.steps.length) {
      this.parts = null;
      renderNote(this.body, 'No step timing recorded for this run.');
      return;
    }
    if (!this.parts) this.build();
    const { summary, missing, breakdown, ratio } = this.parts;
    const x = series.steps;
    renderSummary(summary, x[x.length - 1], timingSummaryItems(series));
    const lines = [];
    const absent = [];
    const drawn = [];
    for (const part of TIMING_PARTS) {
      const values = series.values[part.column];
      if (isMeasured(values)) {
        lines.push({ label: part.label, values, stroke: PART_COLORS[part.column], width: 1.5 });
        drawn.push(part.column);
      } else {
        absent.push(part.label);
      }
    }
    const { traced, top } = tracedSteps(series, drawn);
    const tracedMarkers = traced.map(({ step, seconds }) => ({
      step,
      kind: 'traced',
      label: `traced the step function (compile): ${formatSeconds(seconds)}, off the y-axis`,
    }));
    breakdown.note.textContent = traced.length
      ? `Step ${traced.map((t) => t.step).join(', ')} traced (compiled) the step function ` +
        `(${traced.map((t) => formatSeconds(t.seconds)).join(', ')}); the y-axis scales to ` +
        'the other steps.'
      : '';
    breakdown.note.hidden = !traced.length || top === null;
    breakdown.box.dataset.yMax = top === null ? '' : String(top); // '' : scaled to every step
    breakdown.chart.update({
      x,
      series: lines,
      scales: {
        y: { unit: 'seconds', label: 'seconds per step', ...(top === null ? {} : { max: top }) },
      },
      markers: [...markers, ...tracedMarkers],
    });
    const ratioValues = series.values.overlap_ratio;
    const ratioMeasured = isMeasured(ratioValues);
    if (!ratioMeasured) absent.push('overlap ratio');
    ratio.note.textContent = ratioMeasured ? '' : 'Overlap ratio: not measured.';
    ratio.note.hidden = ratioMeasured;
    ratio.box.hidden = !ratioMeasured;
    if (ratioMeasured) {
      ratio.chart.update({
        x,
        series: [{ label: 'overlap ratio', values: ratioValues, stroke: '#12a05c', width: 1.5 }],
        scales: { y: { unit: 'ratio', max: 1, label: 'overlap ratio' } },
        markers,
      });
    }
    missing.textContent = absent.length ? `Not measured: ${absent.join(', ')}.` : '';
    missing.hidden = !absent.length;
  }

  resize() {
    if (!this.parts) return;
    this.parts.breakdown.chart.resize();
    this.parts.ratio.chart.resize();
  }
}
