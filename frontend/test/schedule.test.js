// node --test: the drawing scheduler runs jobs in order, in tasks of about a budget.
import assert from 'node:assert/strict';
import { test } from 'node:test';
import { Scheduler, postTask } from '../src/schedule.js';

/** A scheduler on a fake clock whose tasks run when `tick()` is called. */
function fake(budgetMs) {
  let clock = 0;
  const tasks = [];
  const scheduler = new Scheduler({ budgetMs, now: () => clock, nextTask: (run) => tasks.push(run) });
  return {
    scheduler,
    advance: (ms) => {
      clock += ms;
    },
    tick: () => tasks.shift()(),
    booked: () => tasks.length,
  };
}

test('jobs run in order, in tasks that stop taking jobs past the budget', async () => {
  const f = fake(40);
  const ran = []; // [job, task]
  const results = [];
  for (let i = 0; i < 7; i++) {
    results.push(
      f.scheduler.run(() => {
        ran.push([i, f.scheduler.tasks]);
        f.advance(15); // each job takes 15 ms
        return i * i;
      }),
    );
  }
  assert.equal(f.booked(), 1); // one task booked for the whole queue, nothing ran yet
  assert.deepEqual(ran, []);
  while (f.booked()) f.tick();
  // 15 + 15 + 15 = 45 >= 40: three jobs per task.
  assert.deepEqual(ran, [[0, 1], [1, 1], [2, 1], [3, 2], [4, 2], [5, 2], [6, 3]]);
  assert.deepEqual(await Promise.all(results), [0, 1, 4, 9, 16, 25, 36]);
  assert.equal(f.scheduler.pending, false);
});

test('a job longer than the budget runs alone; a throwing job rejects only its own promise', async () => {
  const f = fake(40);
  const ran = [];
  const slow = f.scheduler.run(() => {
    ran.push('slow');
    f.advance(100);
  });
  const bad = f.scheduler.run(() => {
    throw new Error('boom');
  });
  const after = f.scheduler.run(() => ran.push('after'));
  f.tick();
  assert.deepEqual(ran, ['slow']);
  f.tick();
  assert.deepEqual(ran, ['slow', 'after']);
  await slow;
  await assert.rejects(bad, /boom/);
  assert.equal(await after, 2);
});

test('a job queued after the queue drained books a new task', async () => {
  const f = fake(40);
  await Promise.all([f.scheduler.run(() => 1), Promise.resolve(f.tick())]);
  assert.equal(f.booked(), 0);
  const next = f.scheduler.run(() => 'again');
  assert.equal(f.booked(), 1);
  f.tick();
  assert.equal(await next, 'again');
});

test('postTask runs callbacks in later tasks, in order', async () => {
  const order = [];
  await new Promise((resolve) => {
    postTask(() => order.push(1));
    postTask(() => {
      order.push(2);
      resolve();
    });
    order.push(0); // the current task goes on first
  });
  assert.deepEqual(order, [0, 1, 2]);
});
