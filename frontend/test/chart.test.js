// The chart's pure helpers (the uPlot drawing itself is covered by the browser tests).
import assert from 'node:assert/strict';
import { test } from 'node:test';
import { lastIndex, UNITS } from '../src/views/chart.js';

test('lastIndex: the last step with a finite value in any series', () => {
  assert.equal(lastIndex([[0, 1, 2, 3], [5, 6, null, null], [1, null, 7, NaN]]), 2);
  assert.equal(lastIndex([[0, 1], [null, null]]), null);
  assert.equal(lastIndex([[]]), null);
  assert.equal(lastIndex([[0, 1, 2], [1, 2, 3]]), 2);
});

test('every unit has an axis title', () => {
  for (const [name, unit] of Object.entries(UNITS)) {
    assert.equal(typeof unit.title, 'string', name);
    assert.ok(unit.title.length > 0, name);
  }
});
