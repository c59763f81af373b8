-- Argo CD health for pdserve.io/DisaggregatedModel: Healthy only when the operator has seen the
-- current generation and every pool is ready; Degraded on an invalid spec or stuck pods.
local hs = {}
if obj.status == nil or obj.status.conditions == nil then
  hs.status = "Progressing"
  hs.message = "waiting for the pdserve operator"
  return hs
end
local generation = obj.metadata.generation or 0
if (obj.status.observedGeneration or 0) < generation then
  hs.status = "Progressing"
  hs.message = "the operator has not reconciled generation " .. generation .. " yet"
  return hs
end
local ready, degraded
for _, condition in ipairs(obj.status.conditions) do
  if condition.type == "Ready" then ready = condition end
  if condition.type == "Degraded" then degraded = condition end
end
if obj.status.phase == "Failed" or (degraded ~= nil and degraded.status == "True") then
  hs.status = "Degraded"
  hs.message = (degraded and degraded.message) or "invalid spec"
  return hs
end
if ready ~= nil and ready.status == "True" then
  hs.status = "Healthy"
  hs.message = ready.message or "every pool is ready"
  return hs
end
hs.status = "Progressing"
hs.message = (ready and ready.message) or "pools are starting"
return hs
