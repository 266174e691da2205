// View: the placement table of one run (memory_hierarchy/placement): every variable with
// its shape, bytes, partitioning and the tiers of its parameter, gradient and optimizer
// state. Sortable by clicking a header (again: reverse), filterable by a text box.
// Text only: every cell is set with textContent.

import { filterPlacement, PLACEMENT_COLUMNS, shapeText, sortPlacement } from '../data.js';
import { formatBytes } from '../format.js';
import { el, renderNote } from './run_panel.js';

function cellText(column, value) {
  if (column.type === 'shape') return shapeText(value);
  if (column.type === 'bytes') return typeof value === 'number' ? formatBytes(value) : '—';
  return value === undefined || value === null ? '—' : String(value);
}

/** The placement table of one run; create once, then update with new records. */
export class PlacementTable {
  /** @param {HTMLElement} body the section's body */
  constructor(body) {
    this.body = body;
    this.rows = [];
    this.sortKey = 'bytes';
    this.sortDir = 'desc';
    this.query = '';
    this.parts = null;
  }

  build() {
    const controls = el('div', 'mh-placement-controls');
    const filter = el('input', 'mh-placement-filter');
    filter.type = 'search';
    filter.placeholder = 'Filter variables (name, tier, partitioning)';
    filter.setAttribute('aria-label', 'Filter variables');
    filter.value = this.query;
    filter.addEventListener('input', () => {
      this.query = filter.value;
      this.renderRows();
    });
    const count = el('span', 'mh-placement-count');
    controls.append(filter, count);
    const scroller = el('div', 'mh-table-scroll');
    const table = el('table', 'mh-placement');
    const head = el('tr');
    const headers = new Map();
    for (const column of PLACEMENT_COLUMNS) {
      const th = el('th', 'mh-sortable');
      th.dataset.key = column.key;
      th.setAttribute('role', 'columnheader');
      th.tabIndex = 0;
      th.append(el('span', null, column.label), el('span', 'mh-sort-mark', ''));
      const sort = () => {
        this.sortDir = this.sortKey === column.key && this.sortDir === 'asc' ? 'desc' : 'asc';
        this.sortKey = column.key;
        this.renderRows();
      };
      th.addEventListener('click', sort);
      th.addEventListener('keydown', (e) => {
        if (e.key === 'Enter' || e.key === ' ') {
          e.preventDefault();
          sort();
        }
      });
      headers.set(column.key, th);
      head.append(th);
    }
    const thead = el('thead');
    thead.append(head);
    const tbody = el('tbody');
    table.append(thead, tbody);
    scroller.append(table);
    this.body.replaceChildren(controls, scroller);
    this.parts = { count, tbody, headers, table };
  }

  /**
   * @param {object|null} answer a /json answer for memory_hierarchy/placement (null: none)
   */
  update(answer) {
    const events = answer?.events ?? [];
    const latest = events.length ? events[events.length - 1] : null;
    const variables = latest?.value?.variables;
    if (!Array.isArray(variables)) {
      this.parts = null;
      renderNote(this.body, 'No placement recorded for this run.');
      return;
    }
    if (!this.parts) this.build();
    this.rows = variables.filter((v) => v && typeof v === 'object');
    this.parts.table.dataset.step = String(latest.step);
    this.renderRows();
  }

  renderRows() {
    const { count, tbody, headers, table } = this.parts;
    const shown = sortPlacement(filterPlacement(this.rows, this.query), this.sortKey, this.sortDir);
    table.dataset.sortKey = this.sortKey;
    table.dataset.sortDir = this.sortDir;
    for (const [key, th] of headers) {
      const active = key === this.sortKey;
      th.setAttribute('aria-sort', active ? (this.sortDir === 'asc' ? 'ascending' : 'descending') : 'none');
      th.lastChild.textContent = active ? (this.sortDir === 'asc' ? ' ▲' : ' ▼') : '';
    }
    const fragment = document.createDocumentFragment();
    for (const row of shown) {
      const tr = el('tr');
      tr.dataset.name = String(row.name ?? '');
      if (typeof row.bytes === 'number') tr.dataset.bytes = String(row.bytes);
      for (const column of PLACEMENT_COLUMNS) {
        const td = el('td', `mh-col-${column.key}`, cellText(column, row[column.key]));
        if (column.key === 'name') td.title = String(row.name ?? '');
        tr.append(td);
      }
      fragment.append(tr);
    }
    tbody.replaceChildren(fragment);
    count.textContent = `${shown.length} of ${this.rows.length} variables`;
    count.dataset.shown = String(shown.length);
    count.dataset.total = String(this.rows.length);
  }
}
