// View: predicted (memory_hierarchy/estimate, per_process) versus measured (the last
// step's param + grad + optimizer bytes) model-state bytes per tier, with a bar per figure;
// then the estimate's in-step peak (per_process_peak) versus the measured in-step peak
// (the last step's pool peak, or the allocator peak on the device when higher).

import { predictedVsMeasured } from '../data.js';
import { formatBytes, formatPercent } from '../format.js';
import { el, tierLabel } from './run_panel.js';

function bar(value, max, className) {
  const track = el('span', 'mh-bar-track');
  const fill = el('span', `mh-bar ${className}`);
  fill.style.width = `${max > 0 && value !== null ? Math.max(0, (100 * value) / max) : 0}%`;
  track.append(fill);
  return track;
}

/**
 * The notes under the table: per tier, what the prediction does not model that the
 * measured tier holds (the estimate's `not_modelled`), and a tier predicted at 0 but
 * measured above it.
 * @param {object|null} estimate the latest memory_hierarchy/estimate value
 * @param {Array<{tier, predicted, measured}>} rows predictedVsMeasured's rows
 * @param {(tier: string) => string} label a tier's display name
 * @returns {string[]}
 */
export function estimateNotes(estimate, rows, label) {
  const gaps = estimate?.not_modelled && typeof estimate.not_modelled === 'object' ? estimate.not_modelled : {};
  const notes = [];
  for (const r of rows) {
    const said = Array.isArray(gaps[r.tier]) ? gaps[r.tier].map(String) : [];
    if (said.length) notes.push(`${label(r.tier)}: not modelled: ${said.join('; ')}.`);
    else if (r.predicted === 0 && r.measured) {
      notes.push(`${label(r.tier)}: predicted 0, measured ${formatBytes(r.measured)}: held by something the estimator does not count.`);
    }
  }
  return notes;
}

/**
 * The one line above the table: what is compared with what.
 * @param {number|null} step the last recorded step (null: none yet)
 */
export function estimateExplanation(step) {
  const when = step === null ? 'the last recorded step' : `step ${step}, the last recorded`;
  return (
    'Predicted: the estimator\u2019s bytes per tier for this config and model, computed ' +
    `before training. Measured: ${when} \u2014 parameters + gradients + optimizer ` +
    'states per tier, and the peak inside that step.'
  );
}

/**
 * @param {HTMLTableElement} table
 * @param {object|null} estimate the latest memory_hierarchy/estimate value (null: none)
 * @param {object|null} tiers a /series answer for memory_hierarchy/tiers
 * @param {object|null} runInfo
 */
export function renderEstimate(table, estimate, tiers, runInfo, readings = null) {
  table.replaceChildren();
  if (!estimate) {
    table.dataset.state = 'none';
    table.append(el('caption', 'mh-note', 'No estimate recorded for this run.'));
    return;
  }
  table.dataset.state = 'shown';
  const last = tiers?.steps?.length ? tiers.steps[tiers.steps.length - 1] : null;
  table.append(el('caption', 'mh-estimate-explain', estimateExplanation(last)));
  const rows = predictedVsMeasured(estimate, tiers, readings);
  const max = Math.max(0, ...rows.flatMap((r) => [r.predicted ?? 0, r.measured ?? 0]));
  const head = el('tr');
  const columns = ['tier', 'predicted model states', 'measured model states', 'measured / predicted'];
  columns.push('predicted peak', 'measured peak (in step)', 'peak measured / predicted');
  for (const text of columns) {
    head.append(el('th', null, text));
  }
  table.append(head);
  for (const r of rows) {
    const tr = el('tr');
    tr.dataset.tier = r.tier;
    if (r.predicted !== null) tr.dataset.predictedBytes = String(r.predicted);
    if (r.measured !== null) tr.dataset.measuredBytes = String(r.measured);
    if (r.predictedPeak !== null) tr.dataset.predictedPeakBytes = String(r.predictedPeak);
    if (r.measuredPeak !== null) tr.dataset.measuredPeakBytes = String(r.measuredPeak);
    if (r.measuredPeakSource) tr.dataset.measuredPeakSource = r.measuredPeakSource;
    const predicted = el('td', 'mh-predicted');
    predicted.append(el('span', 'mh-figure', formatBytes(r.predicted)), bar(r.predicted, max, 'mh-bar-predicted'));
    const measured = el('td', 'mh-measured');
    measured.append(el('span', 'mh-figure', formatBytes(r.measured)), bar(r.measured, max, 'mh-bar-measured'));
    tr.append(
      el('th', 'mh-tier', tierLabel(r.tier, runInfo)),
      predicted,
      measured,
      el('td', 'mh-ratio', r.ratio === null ? '—' : formatPercent(r.ratio)),
      el('td', 'mh-predicted-peak', formatBytes(r.predictedPeak)),
      measuredPeakCell(r),
      el('td', 'mh-peak-ratio', r.peakRatio === null ? '—' : formatPercent(r.peakRatio)),
    );
    table.append(tr);
  }
  const notes = estimateNotes(estimate, rows, (tier) => tierLabel(tier, runInfo));
  if (notes.length) {
    // A row spanning the table: the notes stay with the figures they explain.
    const tr = el('tr', 'mh-estimate-notes-row');
    const td = el('td');
    td.colSpan = columns.length;
    const list = el('ul', 'mh-estimate-notes');
    for (const note of notes) list.append(el('li', null, note));
    td.append(list);
    tr.append(td);
    table.append(tr);
  }
}

/** The measured peak's cell, its figure named in its tooltip (allocator or accounting). */
function measuredPeakCell(r) {
  const td = el('td', 'mh-measured-peak', formatBytes(r.measuredPeak));
  if (r.measuredPeakSource) td.title = `the higher of the last step's in-step peaks: ${r.measuredPeakSource}`;
  return td;
}
