// Drawing work in small tasks: a queue of jobs run one after another, in one task while
// it has run less than a time budget, then in the next task (a MessageChannel message,
// which is not throttled like setTimeout and runs in hidden tabs, unlike
// requestAnimationFrame). With hundreds of runs the charts are drawn job by job, so no
// main-thread task is long and the page answers input meanwhile.

export const BUDGET_MS = 40; // a task stops taking jobs once it has run this long (ms)

/**
 * A queue of jobs run in tasks of at most about `budgetMs` (a job is never cut).
 * `now` and `nextTask` are injectable for tests.
 */
export class Scheduler {
  /**
   * @param {object} [options]
   * @param {number} [options.budgetMs]
   * @param {() => number} [options.now] milliseconds
   * @param {(run: () => void) => void} [options.nextTask] calls `run` in a later task
   */
  constructor({ budgetMs = BUDGET_MS, now = () => performance.now(), nextTask = postTask } = {}) {
    this.budgetMs = budgetMs;
    this.now = now;
    this.nextTask = nextTask;
    this.jobs = [];
    this.pending = false; // a task is booked to run the queue
    this.tasks = 0; // tasks that ran jobs (for tests and measurements)
  }

  /**
   * Run `job` in its turn; resolves to its result (rejects with its error).
   * @template T
   * @param {() => T} job
   * @returns {Promise<T>}
   */
  run(job) {
    return new Promise((resolve, reject) => {
      this.jobs.push({ job, resolve, reject });
      if (!this.pending) {
        this.pending = true;
        this.nextTask(() => this.drain());
      }
    });
  }

  drain() {
    this.tasks += 1;
    const start = this.now();
    while (this.jobs.length && this.now() - start < this.budgetMs) {
      const { job, resolve, reject } = this.jobs.shift();
      try {
        resolve(job());
      } catch (err) {
        reject(err);
      }
    }
    if (this.jobs.length) this.nextTask(() => this.drain());
    else this.pending = false;
  }
}

let channel = null;
const waiting = [];

/** Call `run` in a new task (a MessageChannel message; setTimeout where there is none). */
export function postTask(run) {
  if (typeof MessageChannel !== 'function') {
    setTimeout(run, 0);
    return;
  }
  if (!channel) {
    const opened = new MessageChannel();
    opened.port1.onmessage = () => {
      const next = waiting.shift();
      if (!waiting.length) {
        // Closed when idle (a listening port keeps a Node process alive); reopened as needed.
        opened.port1.close();
        if (channel === opened) channel = null;
      }
      next?.();
    };
    channel = opened;
  }
  waiting.push(run);
  channel.port2.postMessage(null);
}

/** The page's scheduler: every chart drawing of the view goes through it. */
export const drawing = new Scheduler();
