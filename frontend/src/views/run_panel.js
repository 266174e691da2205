// View: one run's panel (name, facts, status line, chart box, last-step readout).
// Builds DOM from data and nothing else. Every text from the logdir (run names, device
// descriptions) goes through textContent, never through HTML.

import { formatBytes } from '../format.js';

export const TIERS = ['device', 'host', 'nvme'];
export const STANDIN_LABEL = 'device (CPU stand-in)';

function el(tag, className, text) {
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

/** Create the (empty) panel of one run. */
export function createRunPanel(run) {
  const element = el('section', 'mh-run');
  element.dataset.run = run;
  const title = el('h2', 'mh-run-name', run);
  const facts = el('p', 'mh-facts');
  const status = el('p', 'mh-status');
  const heading = el('h3', 'mh-chart-title', 'Tier occupancy');
  const chartBox = el('div', 'mh-chart');
  const readout = el('table', 'mh-readout');
  element.append(title, facts, status, heading, chartBox, readout);
  return { element, facts, status, chartBox, readout };
}

/** Show a status or error line in a panel ('' hides it). */
export function renderStatus(statusEl, text, isError = false) {
  statusEl.textContent = text;
  statusEl.hidden = !text;
  statusEl.classList.toggle('mh-error', isError);
}

/** Render the run_info facts: stage, replicas, device tier, fallback. */
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
  if (runInfo.device_is_standin === true) {
    factsEl.append(el('span', 'mh-standin', STANDIN_LABEL));
  }
  if (runInfo.fallback_mirrored === true) {
    factsEl.append(el('span', 'mh-fallback', 'fallback: MirroredStrategy'));
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
