// View: the run selector, as in TensorBoard: a checkbox per run (with its color), a regex
// filter, and "all"/"none". It reports changes through a callback and keeps no data.

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
   */
  constructor(container, onChange) {
    this.onChange = onChange;
    this.runs = [];
    this.selected = new Set();
    this.known = new Set();
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
    this.renderList();
    this.onChange(new Set(this.selected));
  }

  /**
   * Show these runs; a run seen for the first time is selected (TensorBoard's default).
   * @param {string[]} runs sorted names
   * @returns {Set<string>} the selection
   */
  setRuns(runs) {
    const same = runs.length === this.runs.length && runs.every((r, i) => r === this.runs[i]);
    for (const run of runs) {
      if (!this.known.has(run)) {
        this.known.add(run);
        this.selected.add(run);
      }
    }
    for (const run of [...this.selected]) if (!runs.includes(run)) this.selected.delete(run);
    this.runs = runs;
    if (!same) this.renderList();
    return new Set(this.selected);
  }

  renderList() {
    const match = this.matcher();
    this.list.replaceChildren();
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
        this.onChange(new Set(this.selected));
      });
      const swatch = el('span', 'mh-swatch');
      swatch.style.background = runColor(index);
      label.append(box, swatch, el('span', 'mh-run-option-name', run));
      this.list.append(label);
    });
  }
}
