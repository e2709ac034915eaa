// Builds the UI into ../assets/: index.html, app.js (markdown-it and DOMPurify
// bundled in), app.css. The output is committed, so installing bmoe needs no Node;
// scripts/check-ui-built rebuilds and fails when assets/ differ.
//
//   node build.mjs [--outdir DIR]

import { build } from 'esbuild';
import { copyFile, mkdir } from 'node:fs/promises';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';

const here = dirname(fileURLToPath(import.meta.url));
const argIndex = process.argv.indexOf('--outdir');
const outdir = resolve(argIndex > 0 ? process.argv[argIndex + 1] : join(here, '..', 'assets'));

const common = {
  bundle: true,
  minify: true,
  legalComments: 'eof',
  target: ['es2020', 'chrome100', 'firefox100', 'safari15'],
  logLevel: 'warning',
  absWorkingDir: here,
};

await mkdir(outdir, { recursive: true });
await build({ ...common, entryPoints: ['src/main.js'], outfile: join(outdir, 'app.js'), format: 'iife', platform: 'browser' });
await build({ ...common, entryPoints: ['src/app.css'], outfile: join(outdir, 'app.css') });
await copyFile(join(here, 'src', 'index.html'), join(outdir, 'index.html'));
console.log(`built the UI into ${outdir}`);
