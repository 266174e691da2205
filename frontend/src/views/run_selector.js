// View: the run selector, as in TensorBoard: a checkbox per run (with its color), a regex
// filter, and "all"/"none". It reports changes through a callback and keeps no data.
// A first visit selects the most recent runs only (selection.js); the user's choice is
// remembered in localStorage.

import {
  DEFAULT_SELECTED_RUNS,
  loadSelection,
  mergeSelection,
  pageStorage,
  saveSelection,
} from '../selection.js';
import { el } from './run_panel.js';

// TensorBoard's run palette (the first colors of its default scheme).
export const RUN_COLORS = [
  '#ff7043', '#0077bb', '#cc3311', '#33bbee', '#ee3377', '#009988', '#bbbbbb',
  '#ff9800', '#4caf50', '#9c27b0', '#795548', '#607d8b',
];

/** The color of the i-th run (by sorted name). */
export function runColor(index) {
  return RUN_COLORS[index % RUN_COLORS.length];
}

export class RunSelector {
  /**
   * @param {HTMLElement} container
   * @param {(selected: Set<string>) => void} onChange
   * @param {object} [options]
   * @param {Storage|null} [options.storage] where the choice is remembered (localStorage)
   * @param {number} [options.limit] runs selected by default (the most recent ones)
   */
  constructor(container, onChange, { storage = pageStorage(), limit = DEFAULT_SELECTED_RUNS } = {}) {
    this.onChange = onChange;
    this.storage = storage;
    this.limit = limit;
    this.runs = [];
    const stored = loadSelection(storage);
    this.selected = stored?.selected ?? new Set();
    this.known = stored?.known ?? new Set();
    this.filter = '';
    this.element = el('fieldset', 'mh-runs-selector');
    this.element.append(el('legend', null, 'Runs'));
    const controls = el('div', 'mh-selector-controls');
    this.filterInput = el('input', 'mh-run-filter');
    this.filterInput.type = 'search';
    this.filterInput.placeholder = 'Filter runs (regex)';
    this.filterInput.setAttribute('aria-label', 'Filter runs (regex)');
    this.filterInput.addEventListener('input', () => {
      this.filter = this.filterInput.value;
      this.renderList();
    });
    const all = el('button', 'mh-select-all', 'all');
    all.type = 'button';
    all.addEventListener('click', () => this.setAll(true));
    const none = el('button', 'mh-select-none', 'none');
    none.type = 'button';
    none.addEventListener('click', () => this.setAll(false));
    controls.append(this.filterInput, all, none);
    this.list = el('div', 'mh-run-list');
    this.element.append(controls, this.list);
    container.append(this.element);
  }

  matcher() {
    try {
      const re = new RegExp(this.filter, 'i');
      return (run) => re.test(run);
    } catch {
      const needle = this.filter.toLowerCase();
      return (run) => run.toLowerCase().includes(needle);
    }
  }

  /** Runs visible under the filter. */
  visibleRuns() {
    const match = this.matcher();
    return this.runs.filter((r) => match(r));
  }

  setAll(on) {
    for (const run of this.visibleRuns()) {
      if (on) this.selected.add(run);
      else this.selected.delete(run);
    }
    this.save();
    this.renderList();
    this.onChange(new Set(this.selected));
  }

  save() {
    saveSelection(this.storage, this.selected, this.known);
  }

  /**
   * Show these runs. A run seen for the first time is selected while fewer than `limit`
   * runs are (most recent first); known runs keep the user's choice (selection.js).
   * @param {string[]} runs sorted names
   * @param {Map<string, number>} [recency] run -> its newest wall time (seconds)
   * @returns {Set<string>} the selection
   */
  setRuns(runs, recency = new Map()) {
    const same = runs.length === this.runs.length && runs.every((r, i) => r === this.runs[i]);
    const merged = mergeSelection({
      runs,
      recency,
      selected: this.selected,
      known: this.known,
      limit: this.limit,
    });
    this.selected = merged.selected;
    this.known = merged.known;
    if (merged.changed) this.save();
    this.runs = runs;
    if (!same) this.renderList();
    return new Set(this.selected);
  }

  renderList() {
    const match = this.matcher();
    const fragment = document.createDocumentFragment();
    this.runs.forEach((run, index) => {
      const label = el('label', 'mh-run-option');
      label.dataset.run = run;
      label.hidden = !match(run);
      const box = el('input', 'mh-run-checkbox');
      box.type = 'checkbox';
      box.checked = this.selected.has(run);
      box.value = run;
      box.style.accentColor = runColor(index);
      box.addEventListener('change', () => {
        if (box.checked) this.selected.add(run);
        else this.selected.delete(run);
        this.save();
        this.onChange(new Set(this.selected));
      });
      const swatch = el('span', 'mh-swatch');
      swatch.style.background = runColor(index);
      label.append(box, swatch, el('span', 'mh-run-option-name', run));
      fragment.append(label);
    });
    this.list.replaceChildren(fragment);
  }
}
