// node --test: GET /first_view seeds the model's cache, so the refresh after it sends no
// /series or /json request for the first panels.
import assert from 'node:assert/strict';
import { test } from 'node:test';
import { CHART_POINTS, Model, TAG_RUN_INFO, TAG_TIERS } from '../src/model.js';

function fakeFetch(answers) {
  const asked = [];
  const fn = async (href) => {
    const url = new URL(href);
    asked.push(url);
    const body = answers(url);
    return { ok: true, status: 200, statusText: 'OK', json: async () => body };
  };
  return { fn, asked };
}

const tiers = { run: 'a', tag: TAG_TIERS, steps: [0, 1], values: {} };
const runInfo = { run: 'a', tag: TAG_RUN_INFO, kind: 'json', events: [] };
const listing = [
  { run: 'a', tags: { [TAG_TIERS]: { max_step: 1 }, [TAG_RUN_INFO]: { max_step: 0 } } },
  { run: 'b', tags: { [TAG_TIERS]: { max_step: 7 } } },
];

test('firstView asks once and its answers are served from the cache', async () => {
  const { fn, asked } = fakeFetch((url) => {
    if (url.pathname.endsWith('/first_view')) {
      return {
        runs: listing,
        first_runs: ['a', 'b'],
        points: CHART_POINTS,
        series: { a: { [TAG_TIERS]: tiers }, b: { [TAG_TIERS]: { error: { code: 500, message: 'bad' } } } },
        json: { a: { [TAG_RUN_INFO]: runInfo }, b: {} },
      };
    }
    return { fetched: url.pathname, run: url.searchParams.get('run') };
  });
  const model = new Model('http://tb/data/plugin/memory_hierarchy/', fn);
  const runs = await model.firstView(['a', 'b'], { limit: 10, eager: 4 });
  assert.deepEqual(runs, listing);
  assert.equal(asked.length, 1);
  assert.deepEqual(asked[0].searchParams.getAll('run'), ['a', 'b']);
  assert.equal(asked[0].searchParams.get('limit'), '10');
  assert.equal(asked[0].searchParams.get('eager'), '4');
  assert.equal(asked[0].searchParams.get('points'), String(CHART_POINTS));
  // Seeded under the listing's max_step: no request.
  assert.equal(await model.series('a', TAG_TIERS, 1), tiers);
  assert.equal(await model.json('a', TAG_RUN_INFO, 0), runInfo);
  assert.equal(asked.length, 1);
  // A newer max_step asks again; an error answer was not seeded (its route reports it).
  assert.deepEqual(await model.series('a', TAG_TIERS, 2), { fetched: '/data/plugin/memory_hierarchy/series', run: 'a' });
  assert.deepEqual(await model.series('b', TAG_TIERS, 7), { fetched: '/data/plugin/memory_hierarchy/series', run: 'b' });
  assert.equal(asked.length, 3);
});

test('firstView with no remembered runs sends no run', async () => {
  const { fn, asked } = fakeFetch(() => ({ runs: [], first_runs: [], points: CHART_POINTS, series: {}, json: {} }));
  const model = new Model('http://tb/p/', fn);
  assert.deepEqual(await model.firstView([], { limit: 10, eager: 4 }), []);
  assert.deepEqual(asked[0].searchParams.getAll('run'), []);
});
