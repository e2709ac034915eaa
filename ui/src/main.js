// The page: loads params, config and info, builds the views, follows /api/events.

import { h, byId, fill } from './dom.js';
import { Api } from './api.js';
import { askKey } from './keydialog.js';
import { EventStream } from './events.js';
import { createRenderer } from './markdown.js';
import { Chat } from './chat.js';
import { MetricsView } from './metricsview.js';
import { SettingsView } from './settingsview.js';
import { ModelsView } from './modelsview.js';
import { PlanView } from './planview.js';
import { AgentView } from './agentview.js';
import { ToolsView } from './toolsview.js';
import { BackendsView } from './backendsview.js';

const VIEWS = ['chat', 'settings', 'models', 'plan', 'agent', 'tools'];

class App {
  constructor() {
    this.api = new Api({ askKey });
    this.params = [];
    this.info = null;
    this.metrics = new MetricsView();
    this.models = new ModelsView({ api: this.api });
    this.settings = new SettingsView({ api: this.api, onLoadAgain: () => this.models.loadAgain().catch(() => this.show('models')) });
    this.backends = new BackendsView({ api: this.api, root: byId('view-settings') });
    this.plan = new PlanView({ api: this.api });
    this.chat = new Chat({ api: this.api, renderer: createRenderer(window) });
    this.agent = new AgentView({ api: this.api, renderer: createRenderer(window) });
    this.tools = new ToolsView({
      api: this.api,
      openConversation: (id) => { this.show('agent'); this.agent.open(id); },
      onSkills: (skills) => this.agent.setSkills(skills),
    });
    for (const tab of document.querySelectorAll('.tab[data-view]')) {
      tab.addEventListener('click', () => this.show(tab.dataset.view));
    }
    this.show(VIEWS.includes(location.hash.slice(1)) ? location.hash.slice(1) : 'chat');
    window.addEventListener('hashchange', () => {
      const v = location.hash.slice(1);
      if (VIEWS.includes(v)) this.show(v);
    });
  }

  show(view) {
    for (const v of VIEWS) {
      byId(`view-${v}`).hidden = v !== view;
      const tab = document.querySelector(`.tab[data-view="${v}"]`);
      tab.setAttribute('aria-selected', String(v === view));
    }
    document.body.dataset.current = view;
    if (view === 'plan' && this.plan) this.plan.open();
    if (view === 'tools' && this.tools) this.tools.open();
    if (view === 'settings' && this.backends) this.backends.open();
    if (location.hash.slice(1) !== view) history.replaceState(null, '', `#${view}`);
  }

  async start() {
    try {
      const [params, config, info] = await Promise.all([
        this.api.get('/api/params'),
        this.api.get('/api/config'),
        this.api.get('/api/info'),
      ]);
      this.params = params;
      this.settings.setParams(params);
      this.settings.setConfig(config);
      this.models.setConfig(config);
      this.chat.setThinkParam(params.find((p) => p.key === 'think'), config.values.think);
      this.onState(info);
      this.models.library.refresh();
    } catch (e) {
      this.banner('start-error', e.message, 'error');
    }
    byId('forget-key').hidden = !this.api.key;
    this.events = new EventStream(this.api, (name, data) => this.onEvent(name, data), (s) => this.onConnection(s));
    this.events.start();
    this.agent.start();
    this.tools.start();
  }

  onEvent(name, data) {
    switch (name) {
      case 'conversation':
      case 'item':
      case 'delta':
        this.agent.onEvent(name, data);
        break;
      case 'task':
      case 'mcp':
        this.tools.onEvent(name, data);
        break;
      case 'state':
        this.onState(data);
        break;
      case 'token':
        this.metrics.token(data);
        if (!this.decoding) {
          this.decoding = true; // the server publishes no state event when a turn starts
          this.renderStatus();
        }
        break;
      case 'done':
        this.metrics.done(data);
        this.decoding = false;
        this.renderStatus();
        break;
      case 'config':
        this.settings.setConfig(data, { fromEvent: true });
        this.models.setConfig(data);
        break;
      case 'plan_progress':
        this.models.planProgress(data);
        this.plan.progressEvent(data);
        break;
      case 'log':
        this.models.addLog(data);
        break;
      case 'download':
        this.models.library.download(data);
        break;
      case 'models_folders':
        this.models.library.setListing(data);
        break;
      case 'backend':
        this.backends.onEvent(data);
        break;
      default:
        break;
    }
  }

  onState(info) {
    const wasReady = this.info && this.info.state === 'ready' && this.info.model && info.model && this.info.model.path === info.model.path && this.info.model.load_s === info.model.load_s;
    this.info = info;
    this.metrics.state(info);
    this.models.state(info);
    this.renderStatus();
    this.renderCtxAdvice();
    if (info.state === 'ready' && !wasReady) {
      // A load ended: reload_required may have changed without a config event.
      this.api.get('/api/config').then((c) => { this.settings.setConfig(c, { fromEvent: true }); }).catch(() => {});
    }
  }

  renderStatus() {
    const info = this.info;
    if (!info) return;
    const m = info.model;
    const text = {
      empty: 'No model loaded',
      planning: 'Planning…',
      loading: 'Loading…',
      ready: m ? m.name : 'Ready',
      error: 'Load failed',
    }[info.state] || info.state;
    const status = byId('status');
    status.dataset.state = info.state;
    fill(status, 
      h('span', { class: 'dot' }),
      h('span', { class: 'status-text', text }),
      info.generating || this.decoding ? h('span', { class: 'status-gen', text: 'generating' }) : null,
    );
    status.title = info.state === 'error' ? info.error : '';
  }

  /** The context warning, only when the server says `warn`, linking the setting. */
  renderCtxAdvice() {
    const advice = this.info.model && this.info.model.ctx_advice;
    const el = byId('ctx-warning');
    if (!advice || !advice.warn) {
      el.hidden = true;
      return;
    }
    const param = this.params.find((p) => p.key === advice.param);
    const label = param ? param.label : advice.param;
    const link = h('a', { href: '#settings', on: { click: (e) => { e.preventDefault(); this.show('settings'); this.settings.focusField(advice.param); } } }, label);
    const why = advice.refused ? 'A request was just refused because it did not fit in the context.' : 'Clients of this server (coding agents) send more than this context holds.';
    el.replaceChildren(h('span', { text: `${why} Raise ` }), link, h('span', { text: ' in Settings and load the model again.' }));
    el.hidden = false;
  }

  onConnection(s) {
    if (s.state === 'live' && this.wasLive === false) {
      this.agent.resync();
      this.tools.resync();
    }
    if (s.state === 'live' || this.wasLive) this.wasLive = s.state === 'live';
    const el = byId('conn');
    el.dataset.state = s.state;
    if (s.state === 'live') el.textContent = 'live';
    else if (s.state === 'connecting') el.textContent = 'connecting…';
    else el.textContent = `reconnecting in ${Math.ceil(s.retryInMs / 1000)} s`;
    el.title = s.detail || '';
  }

  banner(id, text, kind) {
    let el = document.getElementById(id);
    if (!el) {
      el = h('div', { id, class: `banner banner-${kind}`, role: 'alert' });
      byId('banners').append(el);
    }
    el.textContent = text;
  }
}

function boot() {
  const app = new App();
  window.bmoeApp = app; // for a person's console and the browser tests
  app.start();
}

if (document.readyState === 'loading') document.addEventListener('DOMContentLoaded', boot);
else boot();
