// node --test: the pure helpers of the "Compare runs" view.
import assert from 'node:assert/strict';
import { test } from 'node:test';
import {
  defaultPair,
  keepOrDefaultPair,
  lastValue,
  placementSideText,
  tierDiffSeries,
} from '../src/diff.js';

const recency = new Map([
  ['old', 100],
  ['mid', 200],
  ['new', 300],
  ['newest', 400],
]);
const runs = ['mid', 'new', 'newest', 'old'];

test('the default pair is the two most recent selected runs, B the newer', () => {
  assert.deepEqual(defaultPair(runs, new Set(['old', 'mid', 'new']), recency), ['mid', 'new']);
  // one selected: the most recent other run fills in
  assert.deepEqual(defaultPair(runs, new Set(['old']), recency), ['newest', 'old']);
  assert.deepEqual(defaultPair(runs, new Set(), recency), ['new', 'newest']);
  assert.equal(defaultPair(['only'], new Set(['only']), recency), null);
});

test("the user's pair is kept while both runs are listed and distinct", () => {
  const selected = new Set(['new', 'newest']);
  assert.deepEqual(keepOrDefaultPair(['old', 'mid'], runs, selected, recency), ['old', 'mid']);
  assert.deepEqual(keepOrDefaultPair(['gone', 'mid'], runs, selected, recency), ['new', 'newest']);
  assert.deepEqual(keepOrDefaultPair(['mid', 'mid'], runs, selected, recency), ['new', 'newest']);
  assert.deepEqual(keepOrDefaultPair(null, runs, selected, recency), ['new', 'newest']);
});

test('a tier chart takes used and peak differences; the last measured value', () => {
  const answer = {
    steps: [0, 1, 2],
    values: { 'host/used_bytes': [1, -2, null], 'host/peak_bytes': [3, 4, 5] },
  };
  assert.deepEqual(tierDiffSeries(answer, 'host'), { x: [0, 1, 2], used: [1, -2, null], peak: [3, 4, 5] });
  assert.deepEqual(tierDiffSeries(answer, 'nvme').used, []);
  assert.equal(lastValue([1, -2, null]), -2);
  assert.equal(lastValue([null]), null);
});

test('placement cells of one side', () => {
  const side = { param_tier: 'device', grad_tier: 'host', optimizer_tier: 'nvme', partitioning: null };
  assert.equal(placementSideText(side, 'tiers'), 'device / host');
  assert.equal(placementSideText(side, 'optimizer_tier'), 'nvme');
  assert.equal(placementSideText(side, 'partitioning'), '—');
  assert.equal(placementSideText(null, 'tiers'), '—');
});

test('the diff says when the device figures of the two runs are different measures', async () => {
  const { deviceMeasuresDiffer } = await import('../src/views/diff_view.js');
  assert.equal(deviceMeasuresDiffer({ a: 0, b: 3 }), true);
  assert.equal(deviceMeasuresDiffer({ a: 3, b: 3 }), false);
  assert.equal(deviceMeasuresDiffer({ a: 1, b: 2 }), false);
  assert.equal(deviceMeasuresDiffer({ a: null, b: 3 }), false);
});
