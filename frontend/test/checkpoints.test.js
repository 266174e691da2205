// node --test: the Checkpoints table's rows and the step-time chart's checkpoint markers,
// from a GET /checkpoints answer (docs/http/reports.md).
import assert from 'node:assert/strict';
import { test } from 'node:test';
import { checkpointMarkers, checkpointRows } from '../src/data.js';
import { formatMbPerSecond } from '../src/format.js';

const MIB = 2 ** 20;

// As the plugin answers for a run that saved at step 15 and saved and restored at step 35.
const ANSWER = {
  run: 'alpha',
  checkpoints: [
    { step: 15, wall_time: 1.7e9, op: 'save', tag: 'step00000015', path: '/c/step00000015',
      bytes: 48 * MIB, seconds: 0.25, bytes_per_second: 201326592, replicas: 2, rank: 0,
      saved_replicas: null },
    { step: 35, wall_time: 1.7e9, op: 'save', tag: 'step00000035', path: '/c/step00000035',
      bytes: 48 * MIB, seconds: 0.5, bytes_per_second: 100663296, replicas: 2, rank: 0,
      saved_replicas: null },
    { step: 35, wall_time: 1.7e9, op: 'restore', tag: 'step00000035', path: null,
      bytes: null, seconds: 0, bytes_per_second: null, replicas: 2, rank: 0,
      saved_replicas: 2 },
  ],
};

test('checkpointRows converts bytes/s to MB/s and keeps unmeasured values null', () => {
  const rows = checkpointRows(ANSWER);
  assert.deepEqual(rows[0], {
    step: 15, op: 'save', tag: 'step00000015', path: '/c/step00000015',
    bytes: 48 * MIB, seconds: 0.25, mbPerSecond: 201.326592,
  });
  assert.equal(rows[1].mbPerSecond, 100.663296);
  assert.deepEqual([rows[2].bytes, rows[2].mbPerSecond, rows[2].path], [null, null, null]);
  assert.deepEqual(checkpointRows(null), []);
  assert.deepEqual(checkpointRows({ checkpoints: [] }), []);
});

test('checkpointMarkers: one marker per step, kind checkpoint, labelled with every record', () => {
  assert.deepEqual(checkpointMarkers(ANSWER), [
    { step: 15, label: 'checkpoint save step00000015 (48 MiB)', kind: 'checkpoint' },
    {
      step: 35,
      label: 'checkpoint save step00000035 (48 MiB), restore step00000035 (—)',
      kind: 'checkpoint',
    },
  ]);
  assert.deepEqual(checkpointMarkers(null), []);
});

test('formatMbPerSecond shows one decimal and a dash when not measured', () => {
  assert.equal(formatMbPerSecond(201.326592), '201.3');
  assert.equal(formatMbPerSecond(0.04), '0.0');
  assert.equal(formatMbPerSecond(null), '—');
  assert.equal(formatMbPerSecond(Number.NaN), '—');
});
