// node --test: the pure formatting helpers.
import assert from 'node:assert/strict';
import { test } from 'node:test';
import { formatBytes } from '../src/format.js';

test('formatBytes uses binary units with three significant digits', () => {
  assert.equal(formatBytes(0), '0 B');
  assert.equal(formatBytes(1023), '1023 B');
  assert.equal(formatBytes(1536), '1.5 KiB');
  assert.equal(formatBytes(113 * 2 ** 20), '113 MiB');
  assert.equal(formatBytes(4 * 2 ** 30), '4 GiB');
  assert.equal(formatBytes(12.34 * 2 ** 30), '12.3 GiB');
});

test('formatBytes shows unmeasured values as a dash', () => {
  assert.equal(formatBytes(null), '—');
  assert.equal(formatBytes(NaN), '—');
});
