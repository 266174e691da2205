// View: the live-tuning panel of one run (GET /tuning, POST /tune): each tunable key with
// its value in effect, bounds and unit, an input for a new value when this TensorBoard
// allows tuning, and the state of the latest request (pending, applied at step N, rejected
// with its reason). Builds DOM from data; the controller supplies `submit`.
// Each key says when an applied change acts on the running job (`takes_effect`: next step,
// or rebuild for a key only read when the model is built) and whether it acts in this run
// (`acts`); a change that does not is "recorded", never "applied". A job that ended (GET /tuning's `job_ended`: its OOM post-mortem
// exists) offers no form: nothing would read the request.
// A worker's run of a multi-worker job is tuned through its chief's run (the server writes
// there; GET /tuning's `tuning_note` says so and is shown above the table).
// The inputs are built once per key list and kept across refreshes, so polling never
// clobbers what a user is typing.
// What-if: **Predict effect** asks GET /whatif for the inputs' predicted effect (the job's
// recorded access trace replayed through the pool's policy) and shows it beside the
// recorded figures before anything is applied; once requests predicted at apply are
// decided, each is listed with predicted beside measured (GET /tuning's `predictions`).

import {
  changesText,
  formatConfigValue,
  groupDigits,
  parseTunableInput,
  tuneWrittenText,
  tuningStateText,
} from '../data.js';
import { formatBytes } from '../format.js';
import { outcomeText, whatifHeadline, whatifRows, whatifScope } from '../whatif.js';
import { el } from './run_panel.js';

/**
 * A key's bounds cell: the key's own range, and for device_budget_bytes in a run whose
 * paged pool's page size is known, what this run can take (whole pages; at least what its
 * gathers pin at once, which Predict effect finds: one minimum, explained).
 * @param {{key, min, max, unit}} spec
 * @param {number|null} pageSize GET /tuning's `page_size_bytes`
 */
export function boundsText(spec, pageSize = null) {
  const range = `${boundText(spec.min, spec.unit)} \u2026 ${boundText(spec.max, spec.unit)} (${spec.unit})`;
  if (spec.key !== 'device_budget_bytes' || !pageSize) return range;
  return (
    `${range}; this run\u2019s pool: whole pages of ${formatBytes(pageSize)}, and at least what its ` +
    'gathers pin at once (below it Predict effect shows the out-of-memory failure)'
  );
}

function boundText(value, unit) {
  return unit === 'bytes' ? formatBytes(value) : groupDigits(value);
}

/** True when a key's change acts only when the job is rebuilt (GET /tuning's takes_effect). */
export function actsAtRebuild(spec) {
  return typeof spec?.takes_effect === 'string' && spec.takes_effect.startsWith('rebuild');
}

/**
 * True when an applied change of the key changes nothing in this run's job: GET /tuning's
 * `acts` is false (a rebuild key, or a key that does not act at this run's stage).
 */
export function changesNothingNow(spec) {
  return spec?.acts === false || actsAtRebuild(spec);
}

/**
 * The request line: tuningStateText, except that an applied request says which keys
 * changed nothing in the running job (they act at rebuild) and a request without changes
 * is not called applied.
 * @param {object|null} request GET /tuning's request state
 * @param {object[]} keys GET /tuning's keys ({key, takes_effect})
 * @param {number} nowSeconds
 */
export function requestText(request, keys, nowSeconds) {
  if (request?.state !== 'applied') return tuningStateText(request, nowSeconds);
  const v = request.version === null || request.version === undefined ? '' : ` v${request.version}`;
  const changes = request.changes && typeof request.changes === 'object' ? request.changes : {};
  const specs = new Map((keys ?? []).map((k) => [k.key, k]));
  const later = Object.keys(changes).filter((k) => changesNothingNow(specs.get(k)));
  const now = Object.fromEntries(Object.entries(changes).filter(([k]) => !later.includes(k)));
  if (!Object.keys(changes).length) {
    return `Request${v}: changed nothing at step ${request.step} (its values were already in effect).`;
  }
  const pick = (names) => Object.fromEntries(names.map((k) => [k, changes[k]]));
  const rebuild = later.length
    ? `recorded, changes nothing in the running job: ${changesText(pick(later))}`
    : '';
  if (!Object.keys(now).length) return `Request${v} at step ${request.step}: ${rebuild}.`;
  return `Request${v}: applied at step ${request.step} (${changesText(now)})${rebuild ? `; ${rebuild}` : ''}.`;
}

/** The live-tuning panel of one run; create once, then update with each /tuning answer. */
export class TuningPanel {
  /**
   * @param {HTMLElement} body the section's body
   * @param {(updates: Object<string, number>) => Promise<object>} submit posts /tune
   * @param {(updates: Object<string, number>) => Promise<object>} [predict] gets /whatif
   */
  constructor(body, submit, predict = null) {
    this.body = body;
    this.submit = submit;
    this.predict = predict;
    this.keysKey = '';
    this.rows = new Map(); // key -> {row, value, since, input, spec}
    this.note = el('p', 'mh-tuning-note');
    this.job = el('p', 'mh-tuning-job'); // a worker's run: tuning goes to the chief's run
    this.job.hidden = true;
    this.state = el('p', 'mh-tuning-state');
    this.table = el('table', 'mh-tuning-table');
    this.form = el('form', 'mh-tuning-form');
    this.button = el('button', 'mh-tuning-submit', 'Apply to the running job');
    this.button.type = 'submit';
    this.predictButton = el('button', 'mh-tuning-predict', 'Predict effect');
    this.predictButton.type = 'button';
    this.predictButton.addEventListener('click', () => this.onPredict());
    this.message = el('p', 'mh-tuning-message');
    this.message.hidden = true;
    this.whatif = el('div', 'mh-whatif');
    this.whatif.hidden = true;
    this.outcomes = el('ul', 'mh-whatif-outcomes');
    this.outcomes.hidden = true;
    this.form.append(this.table, this.predictButton, this.button, this.message, this.whatif);
    this.form.addEventListener('submit', (event) => {
      event.preventDefault();
      // Enter in an input: apply where the job can take it, else only predict.
      if (this.body.dataset.mode === 'apply') this.onSubmit();
      else if (this.body.dataset.mode === 'predict') this.onPredict();
    });
    this.body.replaceChildren(this.note, this.job, this.state, this.form, this.outcomes);
    this.answer = null;
    this.written = null; // the version this panel wrote and the job has not decided on
  }

  /** Show a message under the button ('' hides it). */
  say(text, isError = false) {
    this.message.textContent = text;
    this.message.hidden = !text;
    this.message.classList.toggle('mh-error', isError);
    this.message.dataset.kind = isError ? 'error' : 'ok';
  }

  buildRows(keys, enabled) {
    this.table.replaceChildren();
    this.rows.clear();
    const head = el('tr');
    const titles = ['setting', 'in effect', 'takes effect', 'bounds', 'meaning'];
    if (enabled) titles.push('new value');
    for (const t of titles) head.append(el('th', null, t));
    this.table.append(head);
    for (const spec of keys) {
      const row = el('tr');
      row.dataset.key = spec.key;
      const value = el('td', 'mh-tuning-value');
      const since = el('span', 'mh-tuning-since');
      const bounds = el('td', 'mh-tuning-bounds', boundsText(spec, this.pageSize));
      const idle = spec.acts === false && !actsAtRebuild(spec) ? ' \u2014 not in this run' : '';
      const effect = el('td', 'mh-tuning-effect', `${spec.takes_effect ?? 'not stated'}${idle}`);
      effect.dataset.rebuild = String(actsAtRebuild(spec));
      effect.dataset.acts = String(spec.acts ?? '');
      row.append(
        el('th', 'mh-tuning-key', spec.key),
        value,
        effect,
        bounds,
        el('td', 'mh-tuning-desc', spec.description),
      );
      let input = null;
      if (enabled) {
        input = el('input', 'mh-tuning-input');
        input.type = 'text';
        input.name = spec.key;
        input.autocomplete = 'off';
        input.placeholder = spec.unit === 'bytes' ? 'bytes, or e.g. 256 MiB' : spec.unit;
        input.setAttribute('aria-label', `new ${spec.key}`);
        const cell = el('td', 'mh-tuning-new');
        cell.append(input);
        row.append(cell);
      }
      this.table.append(row);
      this.rows.set(spec.key, { row, value, since, input, spec });
    }
  }

  /**
   * Draw a /tuning answer (null: could not be loaded).
   * @param {object|null} answer
   * @param {string} [error] the error message when answer is null
   */
  update(answer, error = '') {
    if (!answer) {
      this.note.textContent = `Could not load the tunable settings: ${error}`;
      this.note.className = 'mh-tuning-note mh-error';
      return;
    }
    this.answer = answer;
    this.pageSize = answer.page_size_bytes ?? null;
    const enabled = answer.enabled === true;
    this.body.dataset.enabled = String(enabled);
    const ended = answer.job_ended ?? null;
    // Apply needs a TensorBoard that may tune and a job that still reads requests; Predict
    // effect only the run's recorded access trace (GET /whatif asks nothing of the job),
    // so a finished run or a read-only TensorBoard can still replay a change.
    const editable = enabled && !ended;
    const traceSteps = answer.trace_steps ?? [];
    const predictable = Boolean(this.predict) && traceSteps.length > 0;
    const inputs = editable || predictable;
    this.body.dataset.mode = editable ? 'apply' : predictable ? 'predict' : 'read-only';
    const keysKey = JSON.stringify([inputs, this.pageSize, answer.keys.map((k) => [k.key, k.unit, k.min, k.max])]);
    if (keysKey !== this.keysKey) {
      this.buildRows(answer.keys, inputs);
      this.keysKey = keysKey;
    }
    this.note.className = 'mh-tuning-note';
    this.body.dataset.jobEnded = String(Boolean(ended));
    if (ended) {
      this.note.textContent = endedText(ended);
    } else {
      this.note.textContent = enabled
        ? 'Changes are written to the run directory; the job reads them at its next step ' +
          'boundary and each takes effect as its \u201ctakes effect\u201d column says.'
        : `Live tuning is off in this TensorBoard: restart it with ${answer.flag} to change ` +
          'these settings from here. They are shown read-only.';
    }
    if (!editable && predictable) this.note.textContent += ` ${predictOnlyText(traceSteps)}`;
    this.note.classList.toggle('mh-tuning-off', !enabled);
    if (answer.run_dir_error) {
      this.note.textContent += ` The run directory cannot be read: ${answer.run_dir_error}`;
    }
    this.job.textContent = answer.tuning_note ?? '';
    this.job.hidden = !answer.tuning_note;
    this.job.dataset.tuningRun = answer.tuning_run ?? '';
    for (const spec of answer.keys) {
      const parts = this.rows.get(spec.key);
      if (!parts) continue;
      parts.row.dataset.value = spec.value === null ? '' : String(spec.value);
      const sinceText =
        spec.since_step === null || spec.since_step === undefined
          ? ''
          : changesNothingNow(spec)
            ? ` recorded at step ${spec.since_step} (v${spec.version}); changes nothing in this job`
            : ` since step ${spec.since_step} (v${spec.version})`;
      parts.since.textContent = sinceText;
      const current = spec.recorded === false ? 'not recorded' : formatConfigValue(spec.key, spec.value);
      parts.value.replaceChildren(
        el('span', 'mh-tuning-current', current),
        parts.since,
      );
    }
    const request = answer.request ?? { state: 'none' };
    this.state.dataset.state = request.state;
    this.state.dataset.version = request.version === null ? '' : String(request.version ?? '');
    this.state.dataset.step = request.step === null ? '' : String(request.step ?? '');
    this.state.textContent = requestText(request, answer.keys, Date.now() / 1000);
    this.state.classList.toggle('mh-error', request.state === 'rejected');
    // "Request vN written; waiting" is stale once the job decided on vN.
    if (this.written !== null && request.version === this.written && request.state !== 'pending') {
      this.written = null;
      this.say('');
    }
    this.button.hidden = !editable;
    this.predictButton.hidden = !inputs || !this.predict;
    this.showOutcomes(answer.predictions ?? []);
  }

  /** List each request predicted at apply with what the job measured (GET /tuning). */
  showOutcomes(predictions) {
    this.outcomes.replaceChildren();
    for (const o of predictions) {
      const li = el('li', 'mh-whatif-outcome', outcomeText(o));
      li.dataset.version = String(o.version);
      li.dataset.appliedStep = o.applied_step === null ? '' : String(o.applied_step ?? '');
      li.dataset.predictedMoves = String(o.predicted?.moves_total ?? '');
      li.dataset.measuredMoves = o.measured ? String(o.measured.moves_total) : '';
      this.outcomes.append(li);
    }
    this.outcomes.hidden = !predictions.length;
  }

  /**
   * The inputs' values: {updates} (possibly empty), or {error} naming the bad input.
   * @returns {{updates?: Object<string, number>, error?: string}}
   */
  readUpdates() {
    const updates = {};
    for (const [key, parts] of this.rows) {
      if (!parts.input) continue;
      const parsed = parseTunableInput(parts.input.value, parts.spec.unit);
      if (parsed === null) continue;
      if (parsed.error) return { error: `${key}: ${parsed.error}` };
      updates[key] = parsed.value;
    }
    return { updates };
  }

  /** The inputs' non-empty values, or null after saying what is wrong (none, or a bad one). */
  checkedUpdates() {
    const { updates, error } = this.readUpdates();
    if (error) {
      this.say(error, true);
      return null;
    }
    if (!Object.keys(updates).length) {
      this.say('Enter a new value for at least one setting.', true);
      return null;
    }
    return updates;
  }

  /** Show the predicted effect of the inputs (GET /whatif), before anything is applied. */
  async onPredict() {
    const updates = this.checkedUpdates();
    if (!updates) return;
    this.say('');
    this.whatif.hidden = false;
    this.whatif.dataset.state = 'loading';
    this.whatif.replaceChildren(el('p', 'mh-whatif-headline', 'Replaying the recorded steps…'));
    try {
      this.showPrediction(await this.predict(updates));
    } catch (err) {
      this.whatif.dataset.state = 'error';
      this.whatif.replaceChildren(el('p', 'mh-whatif-headline mh-error', `No prediction: ${err.message}`));
    }
  }

  /** Draw a /whatif answer: the headline, the table (now vs predicted) and the notes. */
  showPrediction(answer) {
    this.whatif.hidden = false;
    this.whatif.dataset.state = answer.available ? (answer.oom ? 'oom' : 'ready') : 'unavailable';
    const parts = [el('p', 'mh-whatif-headline', whatifHeadline(answer))];
    if (answer.available) {
      const scope = whatifScope(answer);
      if (scope) parts.push(el('p', 'mh-whatif-scope', scope));
      const table = el('table', 'mh-whatif-table');
      const head = el('tr');
      const titles = ['', 'pool now (recorded)', 'pool predicted', 'whole run now (Page moves panel)'];
      for (const t of titles) head.append(el('th', null, t));
      table.append(head);
      for (const row of whatifRows(answer)) {
        const tr = el('tr');
        tr.dataset.key = row.key;
        tr.dataset.now = row.nowValue === null ? '' : String(row.nowValue);
        tr.dataset.predicted = row.predictedValue === null ? '' : String(row.predictedValue);
        tr.dataset.whole = row.wholeValue === null ? '' : String(row.wholeValue);
        tr.append(
          el('th', null, row.label),
          el('td', null, row.now),
          el('td', null, row.predicted),
          el('td', null, row.whole),
        );
        table.append(tr);
      }
      parts.push(table);
      for (const note of answer.notes ?? []) parts.push(el('p', 'mh-whatif-note', note));
    }
    this.whatif.replaceChildren(...parts);
  }

  /** Read the inputs, post the non-empty ones, report the answer. */
  async onSubmit() {
    const updates = this.checkedUpdates();
    if (!updates) return;
    this.button.disabled = true;
    try {
      const answer = await this.submit(updates);
      for (const parts of this.rows.values()) if (parts.input) parts.input.value = '';
      this.say(tuneWrittenText(answer));
      this.written = answer.version;
      if (this.answer) this.update({ ...this.answer, request: answer.request });
    } catch (err) {
      this.written = null;
      this.say(`Not applied: ${err.message}`, true);
    } finally {
      this.button.disabled = false;
    }
  }
}

/**
 * What a panel that cannot apply but can predict says (the run's recorded trace steps).
 * @param {number[]} steps GET /tuning's `trace_steps`
 * @returns {string}
 */
export function predictOnlyText(steps) {
  const span = steps.length > 1 ? `steps ${steps[0]}\u2013${steps[steps.length - 1]}` : `step ${steps[0]}`;
  return (
    `Its recorded access trace (${span}) can still be replayed: enter new values and ` +
    '\u201cPredict effect\u201d shows what the change would have done to those steps; nothing is written.'
  );
}

/**
 * The tuning panel's note for a job that ended (GET /tuning's `job_ended`).
 * @param {{reason: string, step: number}} ended
 * @returns {string}
 */
export function endedText(ended) {
  const how = ended.reason === 'oom'
    ? `ended with an out-of-memory failure at step ${ended.step}`
    : `closed after step ${ended.step - 1}`;
  const advice = ended.reason === 'oom' ? 'apply the advice' : 'apply a change';
  return `This job ${how}: no job reads tuning requests any more. The settings are ` +
    `shown read-only; ${advice} to the next run\u2019s config.`;
}
