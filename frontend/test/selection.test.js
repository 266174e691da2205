// node --test: the run selection (a bounded default, the user's choice remembered).
import assert from 'node:assert/strict';
import { test } from 'node:test';
import {
  STORAGE_KEY,
  byRecency,
  loadSelection,
  mergeSelection,
  recencyOf,
  saveSelection,
} from '../src/selection.js';

function memoryStorage() {
  const items = new Map();
  return {
    getItem: (k) => (items.has(k) ? items.get(k) : null),
    setItem: (k, v) => items.set(k, String(v)),
    items,
  };
}

const names = (n) => Array.from({ length: n }, (_, i) => `run_${String(i).padStart(3, '0')}`);

test('recencyOf takes the newest max_wall_time over the tags', () => {
  const entry = { tags: { a: { max_wall_time: 5 }, b: { max_wall_time: 9.5 }, c: {} } };
  assert.equal(recencyOf(entry), 9.5);
  assert.equal(recencyOf({ tags: {} }), 0);
});

test('a first visit selects only the most recent runs', () => {
  const runs = names(200);
  const recency = new Map(runs.map((r, i) => [r, 1000 + ((i * 37) % 200)]));
  const got = mergeSelection({ runs, recency, selected: new Set(), known: new Set(), limit: 10 });
  assert.equal(got.selected.size, 10);
  assert.deepEqual([...got.selected].sort(), byRecency(runs, recency).slice(0, 10).sort());
  assert.equal(got.known.size, 200);
  assert.equal(got.changed, true);
  // Most recent: recency 1199 .. 1190.
  for (const run of got.selected) assert.ok(recency.get(run) >= 1190);
});

test("the user's choice wins over the default; new runs join while under the limit", () => {
  const runs = names(5);
  const recency = new Map(runs.map((r, i) => [r, i]));
  const first = mergeSelection({ runs, recency, selected: new Set(), known: new Set(), limit: 3 });
  assert.deepEqual([...first.selected].sort(), ['run_002', 'run_003', 'run_004']);
  // The user unselects two and selects the oldest.
  const chosen = new Set(['run_000', 'run_004']);
  const again = mergeSelection({ runs, recency, selected: chosen, known: first.known, limit: 3 });
  assert.deepEqual([...again.selected].sort(), ['run_000', 'run_004']);
  assert.equal(again.changed, false);
  // A new run appears: selected, since 2 < 3 are; a second one then is not.
  const more = [...runs, 'run_new1', 'run_new2'];
  recency.set('run_new1', 50).set('run_new2', 40);
  const grown = mergeSelection({ runs: more, recency, selected: again.selected, known: again.known, limit: 3 });
  assert.deepEqual([...grown.selected].sort(), ['run_000', 'run_004', 'run_new1']);
  assert.ok(grown.known.has('run_new2') && grown.changed);
  // A run that disappears leaves the selection.
  const fewer = mergeSelection({ runs: ['run_000'], recency, selected: grown.selected, known: grown.known, limit: 3 });
  assert.deepEqual([...fewer.selected], ['run_000']);
});

test('the choice round-trips through storage; bad or missing storage gives null', () => {
  const storage = memoryStorage();
  assert.equal(loadSelection(storage), null);
  saveSelection(storage, new Set(['a']), new Set(['a', 'b']));
  const back = loadSelection(storage);
  assert.deepEqual([...back.selected], ['a']);
  assert.deepEqual([...back.known].sort(), ['a', 'b']);
  storage.setItem(STORAGE_KEY, '{not json');
  assert.equal(loadSelection(storage), null);
  storage.setItem(STORAGE_KEY, JSON.stringify({ selected: 'a', known: [] }));
  assert.equal(loadSelection(storage), null);
  assert.equal(loadSelection(null), null);
  const throwing = { getItem() { throw new Error('denied'); }, setItem() { throw new Error('full'); } };
  assert.equal(loadSelection(throwing), null);
  saveSelection(throwing, new Set(), new Set()); // ignored, no throw
});
