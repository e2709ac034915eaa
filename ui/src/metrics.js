// What the engine is doing, from /api/events `token`, `done` and `state` (no DOM).
//
// Rates are read over a short window of recent tokens rather than from one token:
// decode tok/s is tokens over their summed wall time, and flash MiB/s is the MiB
// read over the time the decode waited on flash (`flash_wait_ms`, already the
// term that is a share of the wall in either mode, serial or overlapped).

export const WINDOW_TOKENS = 16;
export const HISTORY_POINTS = 120;

export class Metrics {
  constructor({ window = WINDOW_TOKENS, history = HISTORY_POINTS } = {}) {
    this.windowSize = window;
    this.historySize = history;
    this.recent = [];
    this.last = null; // the latest token event
    this.lastDone = null; // the latest done event (the last turn's summary)
    this.series = { tokS: [], flashMiBTok: [] };
    this.tokens = 0; // token events seen, to tell "moved" in tests and the UI
  }

  token(ev) {
    if (this.last && ev.step <= this.last.step) this.recent = []; // a new turn
    this.last = ev;
    this.tokens += 1;
    this.recent.push(ev);
    if (this.recent.length > this.windowSize) this.recent.shift();
    const rate = this.decodeTokS();
    if (rate !== null) push(this.series.tokS, rate, this.historySize);
    push(this.series.flashMiBTok, Math.max(0, ev.read_mib || 0), this.historySize);
  }

  done(ev) {
    this.lastDone = ev;
  }

  /** Tokens per second over the window; null before two tokens' worth of time. */
  decodeTokS() {
    const wall = sum(this.recent, 'wall_ms');
    return wall > 0 ? (this.recent.length * 1000) / wall : null;
  }

  /** MiB/s read from flash while the decode waited on it; null when it never waited. */
  flashMiBs() {
    const wait = sum(this.recent, 'flash_wait_ms');
    const read = sum(this.recent, 'read_mib');
    return wait > 0 ? (read * 1000) / wait : null;
  }

  /** The share of the wall spent waiting on flash, 0..1; null without tokens. */
  flashShare() {
    const wall = sum(this.recent, 'wall_ms');
    return wall > 0 ? sum(this.recent, 'flash_wait_ms') / wall : null;
  }

  readMiBPerToken() {
    return this.recent.length ? sum(this.recent, 'read_mib') / this.recent.length : null;
  }

  /** The latest figures, each null where there is nothing to show. */
  view() {
    const t = this.last;
    const d = this.lastDone;
    const hit = t && t.cache_hit_pct >= 0 ? t.cache_hit_pct : null;
    return {
      decodeTokS: this.decodeTokS(),
      flashMiBs: this.flashMiBs(),
      flashShare: this.flashShare(),
      readMiBTok: this.readMiBPerToken(),
      cacheHitPct: hit,
      hasCache: t ? t.cache_hit_pct >= 0 : null,
      cacheBudgetMiB: t ? t.cache_budget_mib : d ? d.cache_budget_mib : null,
      rssMiB: t ? t.rss_mib : null,
      memAvailableMiB: t ? t.mem_available_mib : null,
      cpuTempC: t && typeof t.cpu_temp_c === 'number' ? t.cpu_temp_c : null,
      step: t ? t.step : null,
      steps: t ? t.steps : null,
      ttftS: d ? d.ttft_s : null,
      prefillTps: d ? d.prefill_tps : null,
      prefillS: d ? d.prefill_s : null,
      nPrompt: d ? d.n_prompt : null,
    };
  }
}

function sum(list, key) {
  let s = 0;
  for (const x of list) s += Number(x[key]) || 0;
  return s;
}

function push(list, value, max) {
  list.push(value);
  if (list.length > max) list.shift();
}

/** A number for a person: `digits` after the point below 10, fewer above. */
export function fmt(value, digits = 1) {
  if (value === null || value === undefined || !Number.isFinite(value)) return '—';
  const abs = Math.abs(value);
  if (abs >= 100) return Math.round(value).toLocaleString('en-US');
  if (abs >= 10) return value.toFixed(Math.min(digits, 1));
  return value.toFixed(digits);
}

/** MiB as MiB or GiB. */
export function fmtMiB(mib) {
  if (mib === null || mib === undefined || !Number.isFinite(mib)) return '—';
  if (mib >= 1024) return `${(mib / 1024).toFixed(mib >= 10240 ? 1 : 2)} GiB`;
  return `${fmt(mib, mib < 10 ? 1 : 0)} MiB`;
}

export function fmtSeconds(s) {
  if (s === null || s === undefined || !Number.isFinite(s)) return '—';
  if (s < 1) return `${Math.round(s * 1000)} ms`;
  if (s < 60) return `${s.toFixed(s < 10 ? 2 : 1)} s`;
  const m = Math.floor(s / 60);
  return `${m} min ${Math.round(s - m * 60)} s`;
}

/** SVG polyline points for `values` in a `width` x `height` box (min at the bottom). */
export function sparkPoints(values, width, height, pad = 2) {
  const finite = values.filter((v) => Number.isFinite(v));
  if (finite.length < 2) return '';
  const lo = Math.min(0, ...finite);
  const hi = Math.max(...finite);
  const span = hi - lo || 1;
  const step = (width - pad * 2) / (values.length - 1);
  return values
    .map((v, i) => {
      const y = Number.isFinite(v) ? v : lo;
      const py = height - pad - ((y - lo) / span) * (height - pad * 2);
      return `${(pad + i * step).toFixed(1)},${py.toFixed(1)}`;
    })
    .join(' ');
}
