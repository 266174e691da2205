// node --test: what the live-tuning panel says after a POST /tune, for an ordinary run and
// for a worker of a multi-worker job (the request went to the chief's run).
import assert from 'node:assert/strict';
import { test } from 'node:test';
import { tuneWrittenText } from '../src/data.js';

test('tuneWrittenText names the chief run when the request was redirected', () => {
  assert.equal(
    tuneWrittenText({ version: 3, redirected: false, tuning_run: 'job' }),
    'Request v3 written; waiting for the job.',
  );
  assert.equal(
    tuneWrittenText({ version: 1, redirected: true, tuning_run: 'exp/gpt/worker_0' }),
    'Request v1 written to the chief\u2019s run exp/gpt/worker_0 (it decides for every worker of the job); waiting for the job.',
  );
  assert.equal(tuneWrittenText({ version: 2 }), 'Request v2 written; waiting for the job.');
});
