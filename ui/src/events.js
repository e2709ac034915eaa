// The live event stream (GET /api/events), read with fetch so it carries the key,
// reconnected with back-off when the server is full (503 streams_full) or the
// connection is lost.

import { readSSE } from './sse.js';
import { responseError } from './api.js';

export const BACKOFF_FIRST_MS = 500;
export const BACKOFF_MAX_MS = 30000;
const STABLE_MS = 10000; // a connection that lived this long resets the back-off

/** The wait before reconnect attempt `attempt` (0-based), at least `retryAfterS`. */
export function backoffMs(attempt, retryAfterS = 0, random = Math.random) {
  const base = Math.min(BACKOFF_MAX_MS, BACKOFF_FIRST_MS * 2 ** attempt);
  const jittered = base * (0.75 + random() * 0.5);
  return Math.round(Math.min(BACKOFF_MAX_MS, Math.max(jittered, (retryAfterS || 0) * 1000)));
}

export class EventStream {
  /**
   * @param {import('./api.js').Api} api
   * @param {(name: string, data: any) => void} onEvent
   * @param {(status: {state: string, detail?: string, retryInMs?: number}) => void} onStatus
   */
  constructor(api, onEvent, onStatus) {
    this.api = api;
    this.onEvent = onEvent;
    this.onStatus = onStatus;
    this.controller = null;
    this.stopped = false;
  }

  start() {
    this.loop();
  }

  stop() {
    this.stopped = true;
    this.controller?.abort();
  }

  async loop() {
    let attempt = 0;
    while (!this.stopped) {
      this.controller = new AbortController();
      let retryAfter = 0;
      let detail = 'connection lost';
      const opened = Date.now();
      try {
        this.onStatus({ state: 'connecting' });
        const res = await this.api.fetch('GET', '/api/events', undefined, { signal: this.controller.signal });
        if (res.ok) {
          this.onStatus({ state: 'live' });
          await readSSE(res, (ev) => this.dispatch(ev));
          detail = 'the server closed the stream';
        } else {
          retryAfter = Number(res.headers.get('Retry-After')) || 0;
          const err = await responseError(res);
          detail = err.code === 'streams_full' ? 'too many open event streams' : err.message;
        }
      } catch (e) {
        if (this.stopped) return;
        detail = e && e.message ? e.message : 'connection lost';
      }
      if (this.stopped) return;
      if (Date.now() - opened > STABLE_MS) attempt = 0;
      const wait = backoffMs(attempt, retryAfter);
      attempt += 1;
      this.onStatus({ state: 'retrying', detail, retryInMs: wait });
      await new Promise((resolve) => setTimeout(resolve, wait));
    }
  }

  dispatch(ev) {
    let data;
    try {
      data = JSON.parse(ev.data);
    } catch {
      return;
    }
    this.onEvent(ev.event, data);
  }
}
