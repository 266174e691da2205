// node --test: the pure helpers of the live-tuning panel, the OOM view and config events.
import assert from 'node:assert/strict';
import { test } from 'node:test';
import {
  changesText,
  configEvents,
  configLabel,
  configMarkers,
  oomHolders,
  oomRecentSeries,
  parseTunableInput,
  rankedAdvice,
  tuningStateText,
} from '../src/data.js';

const MIB = 2 ** 20;

test('parseTunableInput takes integers and binary byte suffixes, refuses the rest', () => {
  assert.equal(parseTunableInput('', 'steps'), null);
  assert.equal(parseTunableInput('   ', 'bytes'), null);
  assert.deepEqual(parseTunableInput('3', 'steps'), { value: 3 });
  assert.deepEqual(parseTunableInput('1_000', 'elements'), { value: 1000 });
  assert.deepEqual(parseTunableInput('256 MiB', 'bytes'), { value: 256 * MIB });
  assert.deepEqual(parseTunableInput('1.5GiB', 'bytes'), { value: 1.5 * 2 ** 30 });
  assert.deepEqual(parseTunableInput('0', 'steps'), { value: 0 }); // bounds: the server's
  assert.ok(parseTunableInput('2.5', 'steps').error.includes('whole number'));
  assert.ok(parseTunableInput('3 MiB', 'steps').error.includes('unknown unit'));
  assert.ok(parseTunableInput('-1', 'steps').error);
  assert.ok(parseTunableInput('NaN', 'steps').error);
  assert.ok(parseTunableInput('1e3', 'steps').error);
  assert.ok(parseTunableInput('99999999999999999999', 'bytes').error);
});

test('tuningStateText names every request state', () => {
  assert.equal(tuningStateText(null, 0), 'No live-tuning request yet.');
  assert.equal(
    tuningStateText({ state: 'pending', version: 2, requested_at: 100 }, 103.4),
    'Request v2: pending for 3 s; the job applies it at its next step boundary.',
  );
  const changes = {
    telemetry_every_n_steps: { old: 1, new: 3 },
    device_budget_bytes: { old: null, new: 2 ** 30 },
  };
  assert.equal(
    tuningStateText({ state: 'applied', version: 1, step: 57, changes }, 0),
    'Request v1: applied at step 57 (telemetry_every_n_steps 1 → 3, device_budget_bytes not set → 1 GiB).',
  );
  assert.equal(
    tuningStateText({ state: 'rejected', version: 3, step: 60, reason: 'too small' }, 0),
    'Request v3: rejected at step 60: too small',
  );
  assert.ok(tuningStateText({ state: 'ignored', version: 1, step: 4, reason: 'old' }, 0).includes('ignored'));
});

test('runtime decisions label and mark only what changed something', () => {
  const answer = {
    events: [
      { step: 10, value: { version: 1, status: 'applied', step: 10, changes: { telemetry_every_n_steps: { old: 1, new: 3 } }, reason: null } },
      { step: 20, value: { version: 2, status: 'rejected', step: 20, changes: {}, reason: 'budget under one page' } },
      { step: 30, value: { key: 'prefetch_depth', old: 1, new: 2 } },
    ],
  };
  assert.deepEqual(configEvents(answer).map((e) => [e.step, e.status]), [[10, 'applied'], [20, 'rejected'], [30, null]]);
  assert.deepEqual(configMarkers(answer), [
    { step: 10, label: 'v1 applied: telemetry_every_n_steps 1 → 3', version: 1 },
    { step: 30, label: 'prefetch_depth: 1 → 2', version: null },
  ]);
  assert.equal(configLabel(answer.events[1].value), 'v2 rejected: budget under one page');
  assert.equal(changesText({ host_budget_bytes: { old: 512 * MIB, new: 256 * MIB } }), 'host_budget_bytes 512 MiB → 256 MiB');
});

test('OOM helpers: holders largest first, advice by rank, recent steps columnar', () => {
  const pm = {
    tiers: {
      device: { holders: [{ name: 'a', kind: 'param', bytes: 1, pages: 1 }, { name: 'b', kind: 'grad', bytes: 5, pages: null }] },
      host: { holders: [{ name: 'c', kind: 'optimizer', bytes: 3 }] },
      nvme: { holders: [] },
    },
    advice: [{ rank: 2, description: 'two' }, { rank: 1, description: 'one' }, { rank: 3, description: 'three' }],
    recent_steps: [
      { step: 5, tiers: { device: { used_bytes: 50, capacity_bytes: 100 }, nvme: { used_bytes: null, capacity_bytes: null } } },
      { step: 4, tiers: { device: { used_bytes: 40, capacity_bytes: 100 } } },
    ],
  };
  assert.deepEqual(oomHolders(pm).map((h) => [h.tier, h.name, h.bytes, h.pages]), [
    ['device', 'b', 5, null],
    ['host', 'c', 3, null],
    ['device', 'a', 1, 1],
  ]);
  assert.deepEqual(rankedAdvice(pm).map((a) => a.description), ['one', 'two', 'three']);
  assert.deepEqual(oomRecentSeries(pm), {
    steps: [4, 5],
    tiers: { device: { used: [40, 50], capacity: [100, 100] } },
  });
  assert.deepEqual(oomHolders({}), []);
  assert.deepEqual(rankedAdvice({ advice: 'x' }), []);
});

test('an applied request without changes is not drawn; a config marker names key and values', () => {
  const answer = {
    events: [{ step: 5, value: { version: 4, status: 'applied', step: 5, changes: {}, reason: null } }],
  };
  assert.deepEqual(configMarkers(answer), []);
  assert.equal(configLabel(answer.events[0].value), 'v4: no change (values already in effect)');
});

test('an auto headroom decision is labelled with its changes and reason', () => {
  const value = {
    version: 0,
    status: 'applied',
    step: 12,
    source: 'auto',
    changes: { device_budget_bytes: { old: 8388608, new: 6291456 } },
    reason: 'in-step peak over the target',
  };
  assert.equal(
    configLabel(value),
    'auto: device_budget_bytes 8 MiB → 6 MiB (in-step peak over the target)',
  );
});
