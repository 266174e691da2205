// View: page moves of one run: bytes and pages moved per step in each direction, the
// prefetch hit rate and the stall time (memory_hierarchy/pages). A column that was never
// measured is named "not measured", never drawn as zero.

import { DIRECTIONS, hitRate, isMeasured } from '../data.js';
import { formatBytes, formatCount, formatPercent, formatSeconds } from '../format.js';
import { Chart } from './chart.js';
import { el, renderNote, renderSummary } from './run_panel.js';

const HEIGHT = 180; // px
const DIRECTION_COLORS = {
  h2d: '#1a73e8',
  d2h: '#e8710a',
  h2n: '#12a05c',
  n2h: '#9334e6',
  h2n_clean: '#80868b',
};

/** The summary items of the last step (see renderSummary). */
export function pageSummaryItems(series) {
  const last = series.steps.length - 1;
  const v = (column) => series.values[column]?.[last] ?? null;
  const items = [];
  for (const d of DIRECTIONS) {
    const pages = v(`${d.key}_pages`);
    const bytes = v(`${d.key}_bytes`);
    items.push({
      metric: `${d.key}_bytes`,
      label: d.label,
      value: bytes,
      text: `${formatCount(pages)} pages, ${formatBytes(bytes)}`,
    });
  }
  const rate = hitRate([v('prefetch_hits')], [v('prefetch_misses')])[0];
  items.push({ metric: 'prefetch_hit_rate', label: 'prefetch hit rate', value: rate, text: formatPercent(rate) });
  const stall = v('stall_seconds');
  items.push({ metric: 'stall_seconds', label: 'stall', value: stall, text: formatSeconds(stall) });
  return items;
}

/** The page-moves view of one run; create once, then update. */
export class PagesView {
  /** @param {HTMLElement} body the section's body */
  constructor(body) {
    this.body = body;
    this.charts = null;
  }

  build() {
    const summary = el('p', 'mh-summary');
    const missing = el('p', 'mh-missing');
    const grid = el('div', 'mh-grid3');
    const cells = ['Bytes moved per step', 'Pages moved per step', 'Prefetch hit rate and stall'].map(
      (title) => {
        const cell = el('div', 'mh-cell');
        const box = el('div', 'mh-plot');
        cell.append(el('div', 'mh-cell-title', title), box);
        grid.append(cell);
        return new Chart(box, { height: HEIGHT, widthKey: 'grid3' });
      },
    );
    this.body.replaceChildren(summary, missing, grid);
    this.charts = { summary, missing, grid, bytes: cells[0], pages: cells[1], prefetch: cells[2] };
  }

  /**
   * @param {object|null} series a /series answer for memory_hierarchy/pages (null: none)
   * @param {Array<{step, label}>} markers
   */
  update(series, markers) {
    if (!series || !series.steps.length) {
      this.charts = null;
      renderNote(this.body, 'No page moves recorded for this run.');
      return;
    }
    if (!this.charts) this.build();
    const c = this.charts;
    const x = series.steps;
    const last = x[x.length - 1];
    renderSummary(c.summary, last, pageSummaryItems(series));
    // Nothing measured at all: say so once, and draw no empty charts.
    const anyMeasured = Object.values(series.values).some((v) => isMeasured(v));
    c.grid.hidden = !anyMeasured;
    if (!anyMeasured) {
      c.missing.textContent = 'Page moves: not measured by this run.';
      c.missing.hidden = false;
      return;
    }
    const missing = [];
    for (const [chart, suffix, unit, label] of [
      [c.bytes, 'bytes', 'bytes', 'bytes moved per step'],
      [c.pages, 'pages', 'count', 'pages moved per step'],
    ]) {
      const lines = [];
      for (const d of DIRECTIONS) {
        const values = series.values[`${d.key}_${suffix}`];
        if (isMeasured(values)) {
          lines.push({ label: d.label, values, stroke: DIRECTION_COLORS[d.key], width: 1.5 });
        } else if (suffix === 'bytes') {
          missing.push(d.label);
        }
      }
      chart.update({ x, series: lines, scales: { y: { unit, label } }, markers });
    }
    const rate = hitRate(series.values.prefetch_hits, series.values.prefetch_misses);
    const stall = series.values.stall_seconds;
    const extra = [];
    if (isMeasured(rate)) {
      extra.push({ label: 'prefetch hit rate', values: rate, stroke: '#1a73e8', scale: 'y' });
    } else {
      missing.push('prefetch hit rate');
    }
    if (isMeasured(stall)) {
      extra.push({ label: 'stall', values: stall, stroke: '#c5221f', scale: 'stall', dash: [4, 3] });
    } else {
      missing.push('stall');
    }
    c.prefetch.update({
      x,
      series: extra,
      scales: {
        y: { unit: 'ratio', max: 1, label: 'prefetch hit rate' },
        stall: { unit: 'seconds', side: 1, label: 'stall, seconds' },
      },
      markers,
    });
    c.missing.textContent = missing.length ? `Not measured: ${missing.join(', ')}.` : '';
    c.missing.hidden = !missing.length;
  }

  resize() {
    if (!this.charts) return;
    for (const chart of [this.charts.bytes, this.charts.pages, this.charts.prefetch]) chart.resize();
  }
}
