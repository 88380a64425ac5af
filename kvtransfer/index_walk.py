"""The block index's walk on the Redis server (RedisBlockIndex.lookup): one Lua script
reads a stretch of a prompt's block keys in order and answers only the runs, so the
gateway parses a few hundred bytes per lookup instead of every holder field of every
block. Its rules are the client-side walk's (kvtransfer/index_pywalk.py, the reference;
tests/unit/kvtransfer/test_index_walk.py replays random histories against both).
"""

from __future__ import annotations

from typing import Any

# The walk of one stretch of a prompt (index_pywalk._extend's rules, block
# by block). KEYS[1] epochs hash, KEYS[2..] the stretch's block keys in order. ARGV[1]
# '1' when the stretch starts the prompt (any node may start a run there), else ARGV[3]
# is the JSON list of nodes whose run reached the stretch; ARGV[2] the JSON list of
# allowed nodes ('' = all); ARGV[4] how many stale entries to report at most.
# Returns JSON [held, sigs, names, sig_of, stale]: `held` leading blocks of the stretch
# some allowed node holds; per node with a run in the stretch (`names`, in the order
# they first appear in the first block) the index into `sigs` of its run, a run being
# [length, pos, tier, pos, tier ...] listing the positions whose best tier is not
# 'device' (nodes with equal runs share one); stale: [pos, field, epoch, ...] in the
# order met. Epochs are decimal integers below 2^53 (exact in Lua's doubles); an epoch
# that is not counts as older, as in the reference. Empty lists come back as {}.
WALK = """
local first, cap = ARGV[1] == '1', 3 * tonumber(ARGV[4])
local epochs = {}
local flat = redis.call('HGETALL', KEYS[1])
for i = 1, #flat, 2 do epochs[flat[i]] = flat[i + 1] end
local allowed = false
if ARGV[2] ~= '' then
  allowed = {}
  for _, n in ipairs(cjson.decode(ARGV[2])) do allowed[n] = true end
end
-- run: node -> its run's length in this stretch; exc: node -> {pos, tier, ...}; pend:
-- the nodes whose first field in the block being read was not 'device', and best: node
-- -> its best field in that block (read only for the nodes in pend)
local run, best, exc, order = {}, {}, {}, {}
if not first then
  for _, n in ipairs(cjson.decode(ARGV[3])) do run[n] = 0; order[#order + 1] = n end
end
local function older(e, cur)
  local a = tonumber(string.match(e, '^%s*([+-]?%d+)%s*$'))
  local b = tonumber(string.match(cur, '^%s*([+-]?%d+)%s*$'))
  return a == nil or b == nil or a < b
end
local RANK = {device = 0, host = 1, disk = 2}
-- field -> node (false: no node, or not allowed), its node's epoch, tier, tier's rank:
-- each distinct field is parsed once per call
local node_of, cur_of, tier_of, rank_of = {}, {}, {}, {}
local stale, ns, held, pend = {}, 0, 0, {}
for k = 2, #KEYS do
  local p, any, np = k - 2, false, 0
  local row = redis.call('HGETALL', KEYS[k])
  for j = 1, #row, 2 do
    local field = row[j]
    local node = node_of[field]
    if node == nil then
      local n, t = string.match(field, '^(.*)@([^@]*)$')
      if n == nil or n == '' or (allowed and not allowed[n]) then n = false end
      node, node_of[field], tier_of[field], rank_of[field] = n, n, t, RANK[t] or 3
      cur_of[field] = n and epochs[n] or false
    end
    if node then
      local epoch, cur = row[j + 1], cur_of[field]
      if epoch == cur then
        any = true
        local r = run[node]
        if r == nil and p == 0 and first then r = 0; order[#order + 1] = node end
        if r == p then  -- the node's first current field here extends its run
          run[node] = p + 1
          if rank_of[field] > 0 then np = np + 1; pend[np] = node; best[node] = field end
        elseif r == p + 1 then  -- another tier of the same block
          local b = best[node]
          if b and rank_of[field] < rank_of[b] then best[node] = field end
        end
      elseif cur and ns < cap and older(epoch, cur) then
        stale[ns + 1], stale[ns + 2], stale[ns + 3] = p, field, epoch
        ns = ns + 3
      end
    end
  end
  if not any then break end
  held = held + 1
  for i = 1, np do  -- nodes whose first field here was not 'device': their best tier
    local node = pend[i]
    local t = tier_of[best[node]]
    if t ~= 'device' then
      local e = exc[node]
      if e == nil then e = {}; exc[node] = e end
      e[#e + 1] = p; e[#e + 1] = t
    end
  end
end
local sigs, sig_at, names, sig_of = {}, {}, {}, {}
for _, node in ipairs(order) do
  local r, e = run[node], exc[node]
  if r > 0 then
    local key = r
    if e then key = r .. cjson.encode(e) end
    if sig_at[key] == nil then
      local s = {r}
      for j = 1, e and #e or 0 do s[j + 1] = e[j] end
      sigs[#sigs + 1] = s
      sig_at[key] = #sigs - 1
    end
    names[#names + 1] = node
    sig_of[#sig_of + 1] = sig_at[key]
  end
end
return cjson.encode({held, sigs, names, sig_of, stale})
"""


def run_tiers(sig: list[Any]) -> tuple[str, ...]:
    """A node's run from WALK's [length, pos, tier, pos, tier ...] (others: device)."""
    if len(sig) == 1:
        return ("device",) * sig[0]
    tiers = ["device"] * sig[0]
    for p, tier in zip(sig[1::2], sig[2::2], strict=True):
        tiers[p] = tier
    return tuple(tiers)
