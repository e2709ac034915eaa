// Models: the loaded model, a path to load, Load / Unload, the state and a load's
// progress counted on the server's own clock (`load_elapsed_s`).

import { h, byId, fill } from './dom.js';
import { fmtSeconds } from './metrics.js';
import { ModelsLibrary } from './modelslibrary.js';

const STATE_TEXT = {
  empty: 'No model loaded',
  planning: 'Measuring the machine before loading',
  loading: 'Loading',
  ready: 'Ready',
  error: 'The last load failed',
};

export class ModelsView {
  constructor({ api }) {
    this.api = api;
    this.info = null;
    this.clock = null; // {elapsed, at}: the server's seconds and when we got them
    this.timer = 0;
    this.planStep = '';
    this.logLines = [];
    this.root = byId('view-models');
    this.build();
  }

  build() {
    this.stateLine = h('p', { class: 'model-state', id: 'model-state' });
    this.details = h('dl', { class: 'model-details' });
    this.progress = h('div', { class: 'load-progress', hidden: true },
      h('progress', { class: 'load-bar' }),
      h('span', { class: 'load-clock', id: 'load-clock' }));
    this.pathInput = h('input', { id: 'model-path', type: 'text', spellcheck: 'false', placeholder: '/path/to/model.gguf' });
    this.loadButton = h('button', { id: 'model-load', class: 'primary', on: { click: () => this.load() } }, 'Load');
    this.unloadButton = h('button', { id: 'model-unload', on: { click: () => this.unload() } }, 'Unload');
    this.message = h('p', { class: 'model-message', role: 'alert', id: 'model-message', hidden: true });
    this.log = h('ul', { class: 'log-lines' });
    this.forgetKey = h('button', { class: 'link-button', id: 'forget-key', hidden: !this.api.key, on: { click: () => this.forget() } }, 'Forget the key this browser keeps');
    this.root.append(
      h('h2', { class: 'view-title', text: 'Models' }),
      h('section', { class: 'card' },
        h('h3', { text: 'Loaded model' }),
        this.stateLine,
        this.progress,
        this.details),
      h('section', { class: 'card' },
        h('h3', { text: 'Load a model file' }),
        h('label', { for: 'model-path', class: 'field-label', text: 'GGUF file on the server' }),
        h('div', { class: 'path-row' }, this.pathInput, this.loadButton, this.unloadButton),
        this.message),
      this.libraryHost = h('div', { class: 'library', id: 'models-library' }),
      h('section', { class: 'card' },
        h('h3', { text: 'Server messages' }),
        this.log),
      this.forgetKey,
    );
    this.library = new ModelsLibrary({ api: this.api, host: this.libraryHost });
  }

  setConfig(config) {
    if (config && config.values && !this.pathInput.value && document.activeElement !== this.pathInput) {
      this.pathInput.value = config.values.model || '';
    }
  }

  state(info) {
    this.info = info;
    this.library.state(info);
    const s = info.state;
    if ((s === 'loading' || s === 'planning') && typeof info.load_elapsed_s === 'number') {
      this.clock = { elapsed: info.load_elapsed_s, at: performance.now() };
      if (!this.timer) this.timer = setInterval(() => this.tick(), 100);
    } else {
      this.clock = null;
      this.planStep = '';
      clearInterval(this.timer);
      this.timer = 0;
    }
    this.render();
  }

  planProgress(ev) {
    this.planStep = ev.step === 'done' ? '' : ev.label || '';
    this.tick();
  }

  addLog(ev) {
    this.logLines.push(ev);
    if (this.logLines.length > 8) this.logLines.shift();
    this.log.replaceChildren(...this.logLines.map((l) => h('li', { class: `log-${l.level}` }, h('span', { class: 'log-level', text: l.level }), ' ', l.message)));
  }

  /** Seconds since the load began, by the server's clock. */
  elapsed() {
    return this.clock ? this.clock.elapsed + (performance.now() - this.clock.at) / 1000 : null;
  }

  tick() {
    const s = this.elapsed();
    this.progress.hidden = s === null;
    if (s !== null) {
      byId('load-clock').textContent = `${fmtSeconds(s)}${this.planStep ? ` · ${this.planStep}` : ''}`;
    }
  }

  render() {
    const info = this.info;
    if (!info) return;
    const m = info.model;
    this.root.dataset.state = info.state;
    const name = m ? m.name : '';
    fill(this.stateLine, 
      h('span', { class: `pill pill-${info.state}`, text: STATE_TEXT[info.state] || info.state }),
      name ? h('span', { class: 'model-name', text: name }) : null,
    );
    if (info.state === 'error' && info.error) this.show(info.error, true);
    const rows = m ? [
      ['File', m.path],
      ['Architecture', m.arch],
      ['Context', `${m.n_ctx} tokens`],
      ['Experts per token', String(m.n_expert_used)],
      ['Expert streaming', m.streaming ? 'on: experts are read from flash' : 'off: plain llama.cpp on mmap'],
      ['Images', m.vision ? `yes (${m.projector})` : 'no'],
      ['Compute threads', String(m.compute_threads)],
      ['Loaded in', fmtSeconds(m.load_s)],
    ] : [];
    this.details.replaceChildren(...rows.flatMap(([k, v]) => [h('dt', { text: k }), h('dd', { text: v })]));
    const busy = info.state === 'loading' || info.state === 'planning';
    this.loadButton.disabled = busy;
    this.unloadButton.disabled = info.state === 'empty';
    this.tick();
  }

  show(text, error) {
    this.message.hidden = !text;
    this.message.textContent = text || '';
    this.message.classList.toggle('error', Boolean(error));
  }

  async load() {
    const path = this.pathInput.value.trim();
    this.show('');
    try {
      await this.api.json('POST', '/api/session/load', path ? { model: path } : {});
    } catch (e) {
      this.show(e.message, true);
    }
  }

  async unload() {
    this.show('');
    try {
      await this.api.json('POST', '/api/session/unload', {});
    } catch (e) {
      this.show(e.message, true);
    }
  }

  /** Load the configured model again (the settings' reload banner). */
  async loadAgain() {
    try {
      await this.api.json('POST', '/api/session/load', {});
    } catch (e) {
      this.show(e.message, true);
      throw e;
    }
  }

  forget() {
    this.api.forgetKey();
    this.forgetKey.hidden = true;
    location.reload();
  }
}
