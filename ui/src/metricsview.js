// The live metrics panel: the figures of Metrics, two sparklines, the last turn.

import { h, svg, byId, frameThrottle } from './dom.js';
import { Metrics, fmt, fmtMiB, fmtSeconds, sparkPoints } from './metrics.js';

const SPARK_W = 220;
const SPARK_H = 36;

export class MetricsView {
  constructor() {
    this.model = new Metrics();
    this.root = byId('metrics');
    this.info = null;
    this.figures = {};
    this.build();
    this.refresh = frameThrottle(() => this.render());
  }

  build() {
    const fig = (key, label, hint) => {
      const value = h('span', { class: 'fig-value', text: '—' });
      const sub = h('span', { class: 'fig-sub' });
      this.figures[key] = { value, sub };
      return h('div', { class: 'fig', dataset: { metric: key }, title: hint || '' }, h('span', { class: 'fig-label', text: label }), value, sub);
    };
    const spark = (key, label) => {
      const line = svg('polyline', { class: 'spark-line', points: '' });
      const area = svg('polygon', { class: 'spark-area', points: '' });
      const note = h('span', { class: 'spark-note' });
      this.figures[key] = { line, area, note };
      return h(
        'div',
        { class: 'spark', dataset: { spark: key } },
        h('div', { class: 'spark-head' }, h('span', { class: 'spark-label', text: label }), note),
        svg('svg', { viewBox: `0 0 ${SPARK_W} ${SPARK_H}`, preserveAspectRatio: 'none', class: 'spark-svg', role: 'img', 'aria-label': label }, area, line),
      );
    };
    this.streamingNote = h('p', { class: 'note', hidden: true });
    this.progress = h('progress', { class: 'turn-progress', max: 1, value: 0, hidden: true });
    this.summary = h('dl', { class: 'summary' });
    this.root.append(
      h('h2', { class: 'panel-title', text: 'Engine' }),
      this.streamingNote,
      h(
        'div',
        { class: 'figs' },
        fig('decode', 'Decode', 'Tokens per second over the last tokens'),
        fig('flash', 'Flash', 'MiB per second read from storage while the decode waited on it'),
        fig('hit', 'Cache hits', 'Share of routed experts found in the expert cache'),
        fig('ttft', 'First token', 'Time to the first token of the last answer'),
        fig('prefill', 'Prefill', 'Prompt tokens per second in the last answer'),
        fig('budget', 'Cache budget', 'Memory the expert cache may take'),
        fig('rss', 'Process memory', 'Resident memory of the server (RSS)'),
        fig('avail', 'Available memory', 'Memory the system still has available'),
      ),
      this.progress,
      spark('tokS', 'Decode tok/s'),
      spark('flashMiBTok', 'Flash MiB read per token'),
      h('h3', { class: 'panel-sub', text: 'Last answer' }),
      this.summary,
    );
    this.renderSummary();
  }

  token(ev) {
    this.model.token(ev);
    this.generating = true;
    this.refresh();
  }

  done(ev) {
    this.model.done(ev);
    this.generating = false;
    this.renderSummary();
    this.refresh();
  }

  state(info) {
    this.info = info;
    const m = info && info.model;
    this.streamingNote.hidden = !(m && m.streaming === false);
    this.streamingNote.textContent = m && m.streaming === false ? 'Expert streaming is off for this model: the engine runs it as plain llama.cpp on mmap, so no experts are read from flash.' : '';
    this.refresh();
  }

  set(key, value, sub = '') {
    const f = this.figures[key];
    f.value.textContent = value;
    f.sub.textContent = sub;
  }

  render() {
    const v = this.model.view();
    const hostAvail = this.info && this.info.host ? this.info.host.ram_available_mib : null;
    this.set('decode', v.decodeTokS === null ? '—' : `${fmt(v.decodeTokS)} tok/s`, v.step ? `token ${v.step}` : '');
    const share = v.flashShare === null ? '' : `${Math.round(v.flashShare * 100)} % of the time waiting`;
    this.set('flash', v.flashMiBs === null ? (v.readMiBTok === 0 ? 'no reads' : '—') : `${fmt(v.flashMiBs)} MiB/s`, v.flashMiBs === null ? '' : share);
    this.set('hit', v.cacheHitPct === null ? (v.hasCache === false ? 'no cache' : '—') : `${fmt(v.cacheHitPct, 1)} %`);
    this.set('ttft', fmtSeconds(v.ttftS));
    this.set('prefill', v.prefillTps === null ? '—' : `${fmt(v.prefillTps)} tok/s`, v.nPrompt === null ? '' : `${v.nPrompt} tokens in ${fmtSeconds(v.prefillS)}`);
    this.set('budget', v.cacheBudgetMiB ? fmtMiB(v.cacheBudgetMiB) : v.cacheBudgetMiB === 0 ? 'none' : '—');
    this.set('rss', fmtMiB(v.rssMiB));
    this.set('avail', fmtMiB(v.memAvailableMiB ?? hostAvail), v.cpuTempC === null ? '' : `CPU ${fmt(v.cpuTempC, 0)} °C`);
    const generating = this.generating || Boolean(this.info && this.info.generating);
    this.progress.hidden = !(generating && v.steps > 0);
    if (v.steps > 0) {
      this.progress.max = v.steps;
      this.progress.value = Math.min(v.step || 0, v.steps);
    }
    this.root.dataset.tokens = String(this.model.tokens);
    this.renderSpark('tokS', this.model.series.tokS, (x) => `${fmt(x)} tok/s`);
    this.renderSpark('flashMiBTok', this.model.series.flashMiBTok, (x) => fmtMiB(x));
  }

  renderSpark(key, values, label) {
    const f = this.figures[key];
    const points = sparkPoints(values, SPARK_W, SPARK_H);
    f.line.setAttribute('points', points);
    f.area.setAttribute('points', points ? `${points} ${SPARK_W - 2},${SPARK_H} 2,${SPARK_H}` : '');
    const last = values.length ? values[values.length - 1] : null;
    f.note.textContent = last === null ? 'no tokens yet' : label(last);
  }

  renderSummary() {
    const d = this.model.lastDone;
    const n_ctx = this.info && this.info.model ? this.info.model.n_ctx : null;
    if (!d) {
      this.summary.replaceChildren(h('dd', { class: 'empty', text: 'No answer yet.' }));
      return;
    }
    const rows = [
      ['Tokens', `${d.tokens}${d.cancelled ? ' (stopped)' : ''}`],
      ['Decode', `${fmt(d.tok_s)} tok/s`],
      ['First token', fmtSeconds(d.ttft_s)],
      ['Prompt', `${d.n_prompt} tokens, ${fmt(d.prefill_tps)} tok/s`],
      ['Context', n_ctx ? `${d.n_past} of ${n_ctx} tokens` : `${d.n_past} tokens`],
      ['Flash read', `${fmtMiB(d.read_mib)}${d.tokens ? ` (${fmtMiB(d.read_mib / d.tokens)}/token)` : ''}`],
      ['Cache hits', d.cache_hit_pct >= 0 ? `${fmt(d.cache_hit_pct)} %` : 'no cache'],
      ['Per token', `compute ${fmtSeconds(d.compute_s_tok)}, flash ${fmtSeconds(d.flash_wait_s_tok)}`],
    ];
    this.summary.replaceChildren(...rows.flatMap(([k, v]) => [h('dt', { text: k }), h('dd', { text: v })]));
  }
}
