// restartMarkers and goodputFigures: a GET /restarts answer as chart markers and figures.
import assert from 'node:assert/strict';
import { test } from 'node:test';

import { goodputFigures, restartMarkers } from '../src/data.js';

// As the plugin answers for a job killed at step 22 (resumed at 20) and shrunk at 30.
const ANSWER = {
  run: 'alpha',
  markers: [
    { step: 20, kind: 'restart', attempt: 1, nproc: 2, cause: 'restart 1/3 after rank 1',
      steps_lost: 2, seconds_lost: 15, restart_seconds: 9,
      label: 'restart: restart 1/3 after rank 1; lost 2 steps and 15.0 s' },
    { step: 30, kind: 'resize', attempt: 2, nproc: 1, cause: 'resize 2 -> 1 workers',
      steps_lost: 1, seconds_lost: 12.5, restart_seconds: null, label: 'resize: resize 2 -> 1' },
    { step: 31, kind: 'unknown-kind', label: 'x' },
    { step: null, kind: 'restart', label: 'no step' },
  ],
  goodput: { useful_steps: 49, all_steps: 52, steps_ratio: 0.9423, useful_seconds: 24.5,
    wall_seconds: 100, time_ratio: 0.245 },
};

test('restartMarkers: one marker per restart or resize, at its resume step', () => {
  assert.deepEqual(restartMarkers(ANSWER), [
    { step: 20, label: 'restart: restart 1/3 after rank 1; lost 2 steps and 15.0 s', kind: 'restart' },
    { step: 30, label: 'resize: resize 2 -> 1', kind: 'resize' },
    { step: 31, label: 'x', kind: 'restart' },
  ]);
  assert.deepEqual(restartMarkers(null), []);
  assert.deepEqual(restartMarkers({ error: { message: 'x' } }), []);
});

test('goodputFigures: the ratios and their parts, null when absent', () => {
  assert.deepEqual(goodputFigures(ANSWER), {
    stepsRatio: 0.9423, usefulSteps: 49, allSteps: 52, timeRatio: 0.245, usefulSeconds: 24.5,
    wallSeconds: 100,
  });
  assert.equal(goodputFigures({ goodput: null }), null);
  assert.equal(goodputFigures(null), null);
  assert.equal(goodputFigures({ goodput: { steps_ratio: 'x' } }).stepsRatio, null);
});
