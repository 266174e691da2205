// View: "Compare runs" (GET /diff): pick run A and run B, see per tier the difference
// B − A of used and in-step peak bytes over the steps both recorded, the step-time
// difference, whole-run summaries, and the placement diff (variables whose tier,
// sharding or optimizer-state location differ, with the bytes one replica holds).
// Lazy, like the run panels: nothing is fetched until the section is opened; while open
// it is fetched again when either run's steps grow. Text from the logdir via textContent.

import {
  DIFF_TIERS,
  hasValues,
  keepOrDefaultPair,
  lastValue,
  placementSideText,
  tierDiffSeries,
} from '../diff.js';
import { formatBytes, formatCount, formatSeconds } from '../format.js';
import { CHART_POINTS } from '../model.js';
import { Chart } from './chart.js';
import { el, renderExports, renderNote } from './run_panel.js';

const HEIGHT = 180; // px
const USED_COLOR = '#1a73e8';
const PEAK_COLOR = '#d93025';

function signedBytes(v) {
  if (v === null || v === undefined) return '—';
  return `${v > 0 ? '+' : ''}${formatBytes(v)}`;
}

function signedSeconds(v) {
  if (v === null || v === undefined) return '—';
  return `${v > 0 ? '+' : ''}${formatSeconds(v)}`;
}

function signedCount(v) {
  if (v === null || v === undefined) return '—';
  return `${v > 0 ? '+' : ''}${formatCount(v)}`;
}

/** The device figures of a stage-3 run and of a run below stage 3 are different
 * measures (the pool's pages + gradient shards vs TensorFlow's allocator). */
export const MIXED_DEVICE_NOTE =
  'The device figures are as each run records them: TensorFlow’s allocator below stage 3, ' +
  'the pool’s pages + gradient shards at stage 3 — not one measure across these two runs. ' +
  'The selected-runs chart compares the device by the allocator peak.';

/** True when one run is at stage 3 and the other below it. */
export function deviceMeasuresDiffer(stage) {
  const a = stage?.a;
  const b = stage?.b;
  return typeof a === 'number' && typeof b === 'number' && (a === 3) !== (b === 3);
}

export class DiffView {
  /** @param {import('../model.js').Model} model */
  constructor(model) {
    this.model = model;
    this.pair = null; // [A, B]
    this.runs = [];
    this.versions = new Map(); // run -> a value that changes when its steps grow
    this.shownKey = '';
    this.token = 0;
    this.element = el('details', 'mh-diff');
    const summary = el('summary', 'mh-diff-toggle', 'Compare runs (B − A)');
    this.element.append(summary);
    const controls = el('div', 'mh-diff-controls');
    this.selectA = this.runSelect('a', 'Run A');
    this.selectB = this.runSelect('b', 'Run B');
    const swap = el('button', 'mh-diff-swap', 'swap');
    swap.type = 'button';
    swap.addEventListener('click', () => {
      if (!this.pair) return;
      this.pair = [this.pair[1], this.pair[0]];
      this.renderSelects();
      this.load();
    });
    this.exports = el('span', 'mh-exports');
    controls.append(this.selectA.label, this.selectB.label, swap, this.exports);
    this.status = el('p', 'mh-status');
    this.facts = el('div', 'mh-diff-summary');
    const grid = el('div', 'mh-grid3 mh-diff-chart');
    this.charts = new Map();
    this.cells = new Map();
    for (const tier of DIFF_TIERS) {
      const cell = el('div', 'mh-cell mh-diff-tier');
      cell.dataset.tier = tier;
      const box = el('div', 'mh-plot');
      const note = el('p', 'mh-note');
      note.hidden = true;
      cell.append(el('div', 'mh-cell-title', `${tier}: Δ bytes`), box, note);
      grid.append(cell);
      this.cells.set(tier, { cell, note });
      this.charts.set(tier, new Chart(box, { height: HEIGHT, widthKey: 'diff' }));
    }
    const timeCell = el('div', 'mh-cell mh-diff-time');
    const timeBox = el('div', 'mh-plot');
    timeCell.append(el('div', 'mh-cell-title', 'Δ step time'), timeBox);
    grid.append(timeCell);
    this.timeCell = timeCell;
    this.timeChart = new Chart(timeBox, { height: HEIGHT, widthKey: 'diff' });
    this.placement = el('div', 'mh-diff-placement');
    this.body = el('div', 'mh-diff-body');
    this.body.append(
      this.facts,
      grid,
      el('h3', 'mh-chart-title', 'Placement diff'),
      this.placement,
    );
    this.element.append(controls, this.status, this.body);
    this.element.addEventListener('toggle', () => {
      if (this.element.open) this.load();
    });
  }

  runSelect(side, text) {
    const label = el('label', `mh-diff-pick mh-diff-pick-${side}`, `${text} `);
    const select = el('select', `mh-diff-${side}`);
    select.setAttribute('aria-label', text);
    select.addEventListener('change', () => {
      const pair = this.pair ? [...this.pair] : [this.runs[0], this.runs[0]];
      pair[side === 'a' ? 0 : 1] = select.value;
      this.pair = pair;
      this.load();
    });
    label.append(select);
    return { label, select };
  }

  /**
   * The runs listed (by name), the selection and recency (for the default pair) and a
   * version per run (its tiers' max_step): called on every poll.
   */
  setRuns(runs, selected, recency, versions) {
    this.runs = runs;
    this.versions = versions;
    this.element.hidden = runs.length < 2;
    this.pair = keepOrDefaultPair(this.pair, runs, selected, recency);
    this.renderSelects();
    if (this.element.open) this.load();
  }

  renderSelects() {
    for (const [i, { select }] of [this.selectA, this.selectB].entries()) {
      const want = this.pair?.[i] ?? '';
      const same =
        select.options.length === this.runs.length &&
        [...select.options].every((o, k) => o.value === this.runs[k]);
      if (!same) {
        select.replaceChildren(
          ...this.runs.map((run) => {
            const option = el('option', null, run);
            option.value = run;
            return option;
          }),
        );
      }
      select.value = want;
    }
  }

  /** Fetch and draw the pair's diff unless what is drawn is already it. */
  async load() {
    if (!this.pair) return;
    const [a, b] = this.pair;
    const key = JSON.stringify([a, b, this.versions.get(a), this.versions.get(b)]);
    if (key === this.shownKey) return;
    const token = ++this.token;
    this.element.dataset.state = 'loading';
    try {
      const answer = await this.model.diff(a, b, CHART_POINTS);
      if (token !== this.token) return;
      this.shownKey = key;
      this.draw(answer);
      this.status.textContent = '';
      this.status.classList.remove('mh-error');
      this.element.dataset.state = 'drawn';
    } catch (err) {
      if (token !== this.token) return;
      this.shownKey = '';
      this.status.textContent = `Could not compare: ${err.message}`;
      this.status.classList.add('mh-error');
      this.element.dataset.state = 'error';
    }
  }

  draw(answer) {
    const { a, b } = answer;
    this.element.dataset.a = a;
    this.element.dataset.b = b;
    const al = answer.alignment;
    const facts = [
      `Steps compared: ${al.common_steps}` +
        (al.only_a || al.only_b ? ` (only in A: ${al.only_a}, only in B: ${al.only_b})` : ''),
      `ZeRO stage: ${answer.stage.a ?? '—'} → ${answer.stage.b ?? '—'}`,
      `median step time: ${formatSeconds(answer.summary.median_step_seconds.a)} → ` +
        `${formatSeconds(answer.summary.median_step_seconds.b)} ` +
        `(${signedSeconds(answer.summary.median_step_seconds.delta)})`,
    ];
    const table = el('table', 'mh-diff-totals');
    const head = el('tr');
    for (const text of ['', 'A', 'B', 'B − A']) head.append(el('th', null, text));
    table.append(head);
    const row = (metric, label, pair, fmt, signed) => {
      const tr = el('tr');
      tr.dataset.metric = metric;
      if (pair.delta !== null) tr.dataset.delta = String(pair.delta);
      tr.append(el('th', null, label), el('td', null, fmt(pair.a)), el('td', null, fmt(pair.b)));
      tr.append(el('td', 'mh-diff-delta', signed(pair.delta)));
      table.append(tr);
    };
    for (const tier of DIFF_TIERS) {
      const t = answer.summary.tiers[tier];
      const mixed = tier === 'device' && deviceMeasuresDiffer(answer.stage);
      row(`${tier}/peak_bytes`, mixed ? 'device peak (not one measure: see the device chart)' : `${tier} peak`, t.peak_bytes, formatBytes, signedBytes);
      row(`${tier}/last_used_bytes`, `${tier} used (last step)`, t.last_used_bytes, formatBytes, signedBytes);
    }
    for (const dir of ['d2h', 'h2d', 'h2n', 'n2h']) {
      row(`${dir}_pages`, `${dir} page moves (total)`, answer.summary.pages[`${dir}_pages`], formatCount, signedCount);
    }
    this.facts.replaceChildren(el('p', 'mh-facts', facts.join(' · ')), table);

    for (const tier of DIFF_TIERS) {
      const { x, used, peak } = tierDiffSeries(answer, tier);
      const { cell, note } = this.cells.get(tier);
      cell.dataset.points = String(x.length);
      const last = lastValue(used);
      if (last === null) delete cell.dataset.lastUsedDelta;
      else cell.dataset.lastUsedDelta = String(last);
      const measured = hasValues(used) || hasValues(peak);
      const mixed = tier === 'device' && measured && deviceMeasuresDiffer(answer.stage);
      note.hidden = measured && !mixed;
      note.textContent = !measured ? 'Not measured in both runs.' : mixed ? MIXED_DEVICE_NOTE : '';
      this.charts.get(tier).update({
        x,
        series: [
          { label: `Δ used (${b} − ${a})`, values: used, stroke: USED_COLOR, width: 1.5 },
          { label: 'Δ in-step peak', values: peak, stroke: PEAK_COLOR, dash: [4, 3], width: 1.5 },
        ],
        scales: { y: { unit: 'bytes' } },
        markers: [],
      });
    }
    const seconds = answer.values.step_seconds ?? [];
    this.timeCell.dataset.points = String(answer.steps.length);
    this.timeChart.update({
      x: answer.steps,
      series: [{ label: 'Δ step seconds', values: seconds, stroke: '#188038', width: 1.5 }],
      scales: { y: { unit: 'seconds' } },
      markers: [],
    });
    this.drawPlacement(answer.placement);
    const url = (format, part) => this.model.diffExportUrl(a, b, format, part);
    renderExports(this.exports, [
      { label: 'steps CSV', href: url('csv', 'steps'), format: 'csv', scope: 'steps' },
      { label: 'placement CSV', href: url('csv', 'placement'), format: 'csv', scope: 'placement' },
      { label: 'JSON', href: url('json', 'steps'), format: 'json', scope: 'all' },
    ]);
  }

  drawPlacement(placement) {
    const counts = el(
      'p',
      'mh-diff-placement-counts',
      `${placement.differ} differ · ${placement.only_a} only in A · ${placement.only_b} only in B · ` +
        `${placement.equal} equal`,
    );
    for (const key of ['differ', 'only_a', 'only_b', 'equal']) counts.dataset[key] = String(placement[key]);
    if (!placement.rows.length) {
      this.placement.replaceChildren(counts);
      if (placement.step_a === null && placement.step_b === null) {
        renderNote(this.placement, 'Neither run recorded a placement.');
      }
      return;
    }
    const table = el('table', 'mh-placement mh-diff-table');
    const head = el('tr');
    const titles = [
      'variable', 'status', 'tiers A (param / grad)', 'tiers B', 'sharding A', 'sharding B',
      'optimizer state A', 'optimizer state B', 'bytes A', 'bytes B', 'Δ bytes',
    ];
    for (const t of titles) head.append(el('th', null, t));
    const thead = el('thead');
    thead.append(head);
    const tbody = el('tbody');
    for (const r of placement.rows) {
      const tr = el('tr');
      tr.dataset.name = r.name;
      tr.dataset.status = r.status;
      tr.dataset.changed = r.changed.join(' ');
      if (r.bytes_delta !== null) tr.dataset.bytesDelta = String(r.bytes_delta);
      const cells = [
        ['name', r.name],
        ['status', r.status.replace('_', ' ')],
        ['tiers-a', placementSideText(r.a, 'tiers')],
        ['tiers-b', placementSideText(r.b, 'tiers')],
        ['sharding-a', placementSideText(r.a, 'partitioning')],
        ['sharding-b', placementSideText(r.b, 'partitioning')],
        ['optimizer-a', placementSideText(r.a, 'optimizer_tier')],
        ['optimizer-b', placementSideText(r.b, 'optimizer_tier')],
        ['bytes-a', formatBytes(r.bytes_a)],
        ['bytes-b', formatBytes(r.bytes_b)],
        ['bytes-delta', signedBytes(r.bytes_delta)],
      ];
      for (const [key, text] of cells) {
        const td = el('td', `mh-col-${key}`, text);
        tr.append(td);
      }
      tbody.append(tr);
    }
    table.append(thead, tbody);
    const scroller = el('div', 'mh-table-scroll');
    scroller.append(table);
    this.placement.replaceChildren(counts, scroller);
  }

  resize() {
    if (!this.element.open) return;
    for (const chart of this.charts.values()) chart.resize();
    this.timeChart.resize();
  }
}
