// View: one run's panel (name, facts, status line, and one section per view) and the
// small pieces of text it shows. Builds DOM from data and nothing else. Every text from the
// logdir (run names, device descriptions, variable names, config changes) goes through
// textContent, never through HTML.

import { formatBytes } from '../format.js';
import { runBadges } from '../oom.js';

export const TIERS = ['device', 'host', 'nvme'];
export const STANDIN_LABEL = 'device (CPU stand-in)';

/** document.createElement with a class and a text. */
export function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

/**
 * The display name of a tier: "device (CPU stand-in)" when the run's device tier is a
 * budgeted region of host memory standing in for a GPU.
 * @param {string} tier one of TIERS
 * @param {object|null} runInfo the latest memory_hierarchy/run_info value
 */
export function tierLabel(tier, runInfo) {
  return tier === 'device' && runInfo?.device_is_standin === true ? STANDIN_LABEL : tier;
}

function section(view, title) {
  const element = el('div', 'mh-section');
  element.dataset.view = view;
  const head = el('div', 'mh-section-head');
  const heading = el('h3', 'mh-chart-title', title);
  const exports = el('span', 'mh-exports');
  head.append(heading, exports);
  element.append(head);
  return { element, exports };
}

/** Create the (empty) panel of one run; returns its parts by name. */
export function createRunPanel(run) {
  const element = el('section', 'mh-run');
  element.dataset.run = run;
  const title = el('h2', 'mh-run-name', run);
  const facts = el('p', 'mh-facts');
  const status = el('p', 'mh-status');

  const tiers = section('tiers', 'Tier occupancy');
  const chartBox = el('div', 'mh-chart mh-grid3');
  const readout = el('table', 'mh-readout');
  const estimate = el('table', 'mh-estimate');
  const estimateBox = el('div', 'mh-side');
  estimateBox.append(el('h4', 'mh-subtitle', 'Predicted vs measured'), estimate);
  const tables = el('div', 'mh-tables');
  tables.append(readout, estimateBox);
  tiers.element.append(chartBox, tables);

  const pages = section('pages', 'Page moves');
  const pagesBody = el('div', 'mh-view-body');
  pages.element.append(pagesBody);

  const timing = section('timing', 'Step time');
  const timingBody = el('div', 'mh-view-body');
  timing.element.append(timingBody);

  const checkpoints = section('checkpoints', 'Checkpoints');
  const checkpointsBody = el('div', 'mh-view-body');
  checkpoints.element.append(checkpointsBody);

  const restarts = section('restarts', 'Restarts and goodput');
  const restartsBody = el('div', 'mh-view-body');
  restarts.element.append(restartsBody);

  const config = section('config', 'Config changes');
  const configList = el('ul', 'mh-config-list');
  config.element.append(configList);

  const oom = section('oom', 'Out of memory');
  oom.element.classList.add('mh-oom');
  const oomBody = el('div', 'mh-view-body');
  oom.element.append(oomBody);

  const tuning = section('tuning', 'Live tuning');
  const tuningBody = el('div', 'mh-view-body mh-tuning');
  tuning.element.append(tuningBody);

  const placement = section('placement', 'Placement');
  const placementBody = el('div', 'mh-view-body');
  placement.element.append(placementBody);

  element.append(
    title,
    facts,
    status,
    oom.element,
    tiers.element,
    pages.element,
    timing.element,
    checkpoints.element,
    restarts.element,
    config.element,
    tuning.element,
    placement.element,
  );
  return {
    element,
    facts,
    status,
    chartBox,
    readout,
    estimate,
    exports: {
      tiers: tiers.exports,
      pages: pages.exports,
      timing: timing.exports,
      placement: placement.exports,
    },
    pagesBody,
    timingBody,
    checkpointsBody,
    restartsBody,
    configList,
    oomSection: oom.element,
    oomBody,
    tuningBody,
    placementBody,
  };
}

/** Show a status or error line in a panel ('' hides it). */
export function renderStatus(statusEl, text, isError = false) {
  statusEl.textContent = text;
  statusEl.hidden = !text;
  statusEl.classList.toggle('mh-error', isError);
}

/** Render the run_info facts: stage, replicas, device tier, and the badges (oom.js runBadges). */
export function renderFacts(factsEl, runInfo) {
  factsEl.replaceChildren();
  if (!runInfo) {
    factsEl.textContent = 'No run_info recorded yet.';
    return;
  }
  const parts = [
    ['ZeRO stage', runInfo.stage],
    ['replicas', runInfo.num_replicas],
    ['device', runInfo.device_description],
  ];
  for (const [name, value] of parts) {
    if (value === undefined || value === null) continue;
    const fact = el('span', 'mh-fact');
    fact.dataset.fact = name;
    fact.append(el('span', 'mh-fact-name', `${name}: `), el('span', 'mh-fact-value', String(value)));
    factsEl.append(fact);
  }
  for (const badge of runBadges(runInfo, STANDIN_LABEL)) {
    const span = el('span', `mh-${badge.kind}`, badge.text);
    span.dataset.badge = badge.kind;
    factsEl.append(span);
  }
}

/**
 * Render the last step's used and capacity bytes per tier as a table, readable as text
 * and through data-* attributes (data-step; per row data-tier, data-used-bytes,
 * data-capacity-bytes; an attribute is absent when the value was not measured).
 * @param {HTMLTableElement} table
 * @param {object} series a /series answer for memory_hierarchy/tiers
 * @param {object|null} runInfo
 */
export function renderReadout(table, series, runInfo) {
  table.replaceChildren();
  const last = series.steps.length - 1;
  if (last < 0) return;
  table.dataset.step = String(series.steps[last]);
  table.append(el('caption', null, `Step ${series.steps[last]}`));
  const head = el('tr');
  head.append(el('th', null, 'tier'), el('th', null, 'used'), el('th', null, 'capacity'));
  table.append(head);
  for (const tier of TIERS) {
    const cells = series.values[tier];
    if (!cells) continue;
    const used = cells.used_bytes[last];
    const capacity = cells.capacity_bytes[last];
    const row = el('tr');
    row.dataset.tier = tier;
    if (used !== null) row.dataset.usedBytes = String(used);
    if (capacity !== null) row.dataset.capacityBytes = String(capacity);
    row.append(
      el('th', 'mh-tier', tierLabel(tier, runInfo)),
      el('td', 'mh-used', formatBytes(used)),
      el('td', 'mh-capacity', capacity === null ? 'unbounded' : formatBytes(capacity)),
    );
    table.append(row);
  }
}

/**
 * Export links of one section: CSV and JSON, as shown (downsampled) or every step.
 * @param {HTMLElement} box the section's `.mh-exports`
 * @param {Array<{label: string, href: string, format: string, scope: string}>} links
 */
export function renderExports(box, links) {
  box.replaceChildren();
  if (!links.length) return;
  box.append(el('span', 'mh-exports-label', 'Export:'));
  for (const link of links) {
    const a = el('a', 'mh-export', link.label);
    a.href = link.href;
    a.setAttribute('download', '');
    a.dataset.format = link.format;
    a.dataset.scope = link.scope;
    box.append(a);
  }
}

/** A line of text saying a view has no data (or an error). */
export function renderNote(box, text, isError = false) {
  const note = el('p', isError ? 'mh-note mh-error' : 'mh-note', text);
  box.replaceChildren(note);
}

/**
 * The last step's figures of a view as text: "Step N · label value · ...", each figure a
 * span with data-metric (and data-value when measured; the text says "not measured").
 * @param {HTMLElement} p
 * @param {number} step
 * @param {Array<{metric: string, label: string, value: number|null, text: string}>} items
 */
export function renderSummary(p, step, items) {
  p.replaceChildren();
  p.dataset.step = String(step);
  p.append(el('span', 'mh-summary-step', `Step ${step}`));
  for (const item of items) {
    const span = el('span', 'mh-metric');
    span.dataset.metric = item.metric;
    const measured = item.value !== null && item.value !== undefined && !Number.isNaN(item.value);
    if (measured) span.dataset.value = String(item.value);
    else span.classList.add('mh-not-measured');
    span.append(
      el('span', 'mh-metric-name', `${item.label} `),
      el('span', 'mh-metric-value', measured ? item.text : 'not measured'),
    );
    p.append(span);
  }
}
