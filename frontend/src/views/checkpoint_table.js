// View: a run's checkpoint saves and restores (GET /checkpoints) as a small table: step,
// op, tag, bytes, seconds and bandwidth in MB/s (10^6 bytes/s; write bandwidth of a save,
// read bandwidth of a restore). Builds DOM from data and nothing else; the tag and path
// come from the logdir and go through textContent. Readable as data-* attributes too:
// per row data-step, data-op, data-bytes, data-seconds, data-mb-per-second (an attribute
// is absent when the value was not measured).

import { checkpointRows } from '../data.js';
import { formatBytes, formatMbPerSecond, formatSeconds } from '../format.js';
import { el, renderNote } from './run_panel.js';

const COLUMNS = ['step', 'op', 'tag', 'bytes', 'seconds', 'MB/s'];
const RATE_TITLE =
  'bytes / seconds in 10^6 bytes per second: write bandwidth of a save, ' +
  'read bandwidth of a restore';

/**
 * @param {HTMLElement} box the section's body
 * @param {{checkpoints: object[]}|null} answer a /checkpoints answer (null: none)
 * @param {string|null} error why it could not be loaded (null: no error)
 */
export function renderCheckpoints(box, answer, error = null) {
  if (error) {
    renderNote(box, `Could not load: ${error}`, true);
    return;
  }
  const rows = checkpointRows(answer);
  if (!rows.length) {
    renderNote(box, 'No checkpoints recorded for this run.');
    return;
  }
  const table = el('table', 'mh-checkpoints');
  const head = el('tr');
  for (const name of COLUMNS) {
    const th = el('th', null, name);
    if (name === 'MB/s') th.title = RATE_TITLE;
    head.append(th);
  }
  table.append(head);
  for (const r of rows) {
    const tr = el('tr', 'mh-checkpoint');
    tr.dataset.step = String(r.step);
    tr.dataset.op = r.op;
    if (r.bytes !== null) tr.dataset.bytes = String(r.bytes);
    if (r.seconds !== null) tr.dataset.seconds = String(r.seconds);
    if (r.mbPerSecond !== null) tr.dataset.mbPerSecond = String(r.mbPerSecond);
    const tag = el('td', 'mh-checkpoint-tag', r.tag);
    if (r.path) tag.title = r.path;
    tr.append(
      el('td', 'mh-num', String(r.step)),
      el('td', 'mh-checkpoint-op', r.op),
      tag,
      el('td', 'mh-num', formatBytes(r.bytes)),
      el('td', 'mh-num', formatSeconds(r.seconds)),
      el('td', 'mh-num mh-checkpoint-rate', formatMbPerSecond(r.mbPerSecond)),
    );
    table.append(tr);
  }
  box.replaceChildren(table);
}
