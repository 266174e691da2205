// View: a job's restarts and resizes (GET /restarts, written by zero-runtime launch
// --logdir) and its goodput: a summary line (steps kept / steps run, time on kept steps /
// wall time) and one table row per restart or resize (the step it resumed at, what
// happened, workers, the cause, steps and seconds lost, seconds to the first new step).
// Builds DOM from data and nothing else; the cause comes from the logdir and goes through
// textContent. Readable as data-* attributes: the summary's data-steps-ratio and
// data-time-ratio, per row data-step, data-kind, data-steps-lost, data-seconds-lost.

import { goodputFigures } from '../data.js';
import { formatCount, formatPercent, formatSeconds } from '../format.js';
import { el, renderNote } from './run_panel.js';

const COLUMNS = ['step', 'what', 'workers', 'cause', 'steps lost', 'seconds lost', 'to first step'];

/**
 * @param {HTMLElement} box the section's body
 * @param {{markers: object[], goodput: object|null}|null} answer a /restarts answer
 * @param {string|null} error why it could not be loaded (null: no error)
 */
export function renderRestarts(box, answer, error = null) {
  if (error) {
    renderNote(box, `Could not load: ${error}`, true);
    return;
  }
  const markers = answer?.markers ?? [];
  const goodput = goodputFigures(answer);
  if (!markers.length && !goodput) {
    renderNote(box, 'No restarts recorded for this job (zero-runtime launch --logdir writes them).');
    return;
  }
  const parts = [];
  if (goodput) {
    const line = el('p', 'mh-goodput');
    if (goodput.stepsRatio !== null) line.dataset.stepsRatio = String(goodput.stepsRatio);
    if (goodput.timeRatio !== null) line.dataset.timeRatio = String(goodput.timeRatio);
    const ended = answer?.finished ? '' : ' so far';
    line.textContent =
      `Goodput${ended}: ${formatPercent(goodput.stepsRatio)} of steps ` +
      `(${formatCount(goodput.usefulSteps)} kept of ${formatCount(goodput.allSteps)} run), ` +
      `${formatPercent(goodput.timeRatio)} of time ` +
      `(${formatSeconds(goodput.usefulSeconds)} on kept steps of ${formatSeconds(goodput.wallSeconds)}); ` +
      `${formatCount(answer?.restarts ?? 0)} restarts, ${formatCount(answer?.resizes ?? 0)} resizes`;
    parts.push(line);
  }
  if (markers.length) {
    const table = el('table', 'mh-restarts');
    const head = el('tr');
    for (const name of COLUMNS) head.append(el('th', null, name));
    table.append(head);
    for (const m of markers) {
      const tr = el('tr', 'mh-restart');
      tr.dataset.step = String(m.step);
      tr.dataset.kind = String(m.kind);
      if (typeof m.steps_lost === 'number') tr.dataset.stepsLost = String(m.steps_lost);
      if (typeof m.seconds_lost === 'number') tr.dataset.secondsLost = String(m.seconds_lost);
      tr.append(
        el('td', 'mh-num', String(m.step)),
        el('td', 'mh-restart-kind', String(m.kind)),
        el('td', 'mh-num', formatCount(m.nproc)),
        el('td', 'mh-restart-cause', String(m.cause ?? '')),
        el('td', 'mh-num', formatCount(m.steps_lost)),
        el('td', 'mh-num', formatSeconds(m.seconds_lost)),
        el('td', 'mh-num', formatSeconds(m.restart_seconds)),
      );
      table.append(tr);
    }
    parts.push(table);
  }
  box.replaceChildren(...parts);
}
