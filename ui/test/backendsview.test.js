import { test } from 'node:test';
import assert from 'node:assert/strict';
import { sizeText, progressText } from '../src/backendsview.js';

test('pack sizes read as KiB or MiB', () => {
  assert.equal(sizeText(0), '');
  assert.equal(sizeText(300), '1 KiB');
  assert.equal(sizeText(4096), '4 KiB');
  assert.equal(sizeText(3 * 1048576 + 104858), '3.1 MiB');
});

test('backend events read as words', () => {
  assert.equal(progressText(undefined), '');
  assert.equal(progressText({ stage: 'download', received: 50, total: 200 }), 'Downloading 25 %');
  assert.equal(progressText({ stage: 'download', received: 0, total: 0 }), 'Downloading');
  assert.equal(progressText({ stage: 'unpack' }), 'Unpacking');
  assert.equal(progressText({ stage: 'done' }), 'Installed');
  assert.equal(progressText({ stage: 'error', error: 'its SHA-256 does not match' }), 'Failed: its SHA-256 does not match');
});
